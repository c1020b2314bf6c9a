"""Checks a storage pod runs on chunk objects without knowing the reader's expectations.

A pod verifies what it accepts (`object_problem`: a PUT must be one whole, consistent chunk object)
and what it serves (`range_problem`: every whole section inside a read range must carry its magic,
its declared payload length and a matching crc32), so a corrupt copy is reported and dropped rather
than streamed. The reader still checks each section against the key and layer it expects.
"""

from __future__ import annotations

from cacheflow_common.errors import ChunkFormatError
from cacheflow_common.kv.checksum import crc32
from cacheflow_common.kv.chunk import (
    END_MAGIC,
    SECTION_HEADER,
    SECTION_HEADER_SIZE,
    SECTION_MAGIC,
    TRAILER_TAIL,
    _key_of,
    _trailer_span,
    layout_of_trailer,
    read_trailer,
    verify_section,
)


def object_problem(obj: bytes | bytearray | memoryview) -> str:
    """"" if `obj` is a whole, self-consistent chunk object (any kind), else what is wrong with it."""
    mv = memoryview(obj).cast("B")
    try:
        trailer = read_trailer(mv)
        layout, key = layout_of_trailer(trailer), _key_of(trailer)
        if len(mv) != layout.sections_size + _trailer_span(mv) + TRAILER_TAIL.size:
            return "object size does not match its trailer"
    except ChunkFormatError as exc:
        return str(exc)
    for i, layer in enumerate(range(layout.layer_start, layout.layer_end)):
        start = i * layout.section_size
        check = verify_section(mv[start : start + layout.section_size], layout=layout, layer=layer, key=key)
        if not check.ok:
            return f"section of layer {layer}: {check.reason}"
    return ""


def section_size_of(header: bytes | memoryview) -> int:
    """The size of every section of the object whose first section header is `header` (0: not a chunk)."""
    if len(header) < SECTION_HEADER_SIZE:
        return 0
    magic, *_, payload_len, _digest = SECTION_HEADER.unpack_from(header, 0)
    return SECTION_HEADER_SIZE + int(payload_len) if magic == SECTION_MAGIC else 0


def sections_end_of(tail: bytes | memoryview, object_size: int) -> int:
    """Where the sections end (the trailer starts), from the object's last `TRAILER_TAIL.size` bytes; 0 if bad."""
    if len(tail) != TRAILER_TAIL.size:
        return 0
    length, magic = TRAILER_TAIL.unpack(tail)
    end = object_size - TRAILER_TAIL.size - int(length)
    return end if magic == END_MAGIC and end > 0 else 0


def range_problem(buf: memoryview, offset: int, section_size: int, sections_end: int) -> str:
    """Check every whole section inside bytes [offset, offset + len(buf)) of an object; "" when all pass.

    `sections_end`: where the sections stop and the trailer begins. Bytes outside whole sections (a
    partial section, the trailer) are not checked here.
    """
    if section_size <= SECTION_HEADER_SIZE or sections_end <= 0 or sections_end % section_size:
        return "not a chunk object"
    first = -(-offset // section_size)  # the first section starting at or after `offset`
    end = min(offset + len(buf), sections_end)
    digest = None
    while (first + 1) * section_size <= end:
        at = first * section_size - offset
        magic, _layer, _t0, _t1, crc, payload_len, key = SECTION_HEADER.unpack_from(buf, at)
        if magic != SECTION_MAGIC or SECTION_HEADER_SIZE + payload_len != section_size:
            return f"section {first}: bad header"
        if digest is not None and key != digest:
            return f"section {first}: key differs from the section before"
        if crc32(buf[at + SECTION_HEADER_SIZE : at + section_size]) != crc:
            return f"section {first}: crc mismatch"
        digest = key
        first += 1
    return ""
