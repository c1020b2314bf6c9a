"""A read as the pod streams it: the object's layout, and the pieces it is read, checked and sent in.

A read is planned only once the object is known to hold the range (so a miss costs no buffer), and
is then streamed piece by piece through one bounded buffer. Pieces are cut at section boundaries,
so every whole section of the range lies inside one piece and is checked (`range_problem`) before
any of its bytes are sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

PIECE_BYTES = 1024 * 1024  # bytes read, checked and sent at a time (a section larger than this is one piece)


@dataclass(frozen=True, kw_only=True)
class ReadPlan:
    tenant: str
    stored: str  # the backend name
    offset: int  # the range's first byte in the object
    length: int
    section_size: int  # of the object's sections (0: not a chunk object; its first piece fails the check)
    sections_end: int  # where the sections end and the trailer begins
    writes: int = 0  # the pod's count of writes to the object's stripe when the read was planned

    def pieces(self, piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[int, int]]:
        """(start, length) of consecutive pieces, `start` counted from the range's first byte."""
        pos, end, size = self.offset, self.offset + self.length, self.section_size
        while pos < end:
            cut = min(end, pos + piece_bytes)
            if size > 0 and cut < min(end, self.sections_end):  # inside the sections: cut at a boundary
                boundary = cut // size * size
                cut = min(end, boundary if boundary > pos else (pos // size + 1) * size)
            yield pos - self.offset, cut - pos
            pos = cut

    def buffer_bytes(self, piece_bytes: int = PIECE_BYTES) -> int:
        """The largest piece: what one buffer must hold to stream the whole range."""
        return min(self.length, max(piece_bytes, self.section_size))


def slices_within(slices: list[tuple[int, int, float]], start: int, length: int) -> list[tuple[int, int, float]]:
    """The parts of booked slices (offset, n, deadline) that fall in [start, start + length), relative to start."""
    out = []
    for at, n, deadline in slices:
        lo, hi = max(at, start), min(at + n, start + length)
        if lo < hi:
            out.append((lo - start, hi - lo, deadline))
    return out
