"""The pod-side checks: whole objects on write, whole sections inside any read range."""

from __future__ import annotations

from cacheflow_common.kv.chunk import TRAILER_TAIL
from cacheflow_common.kv.integrity import object_problem, range_problem, section_size_of, sections_end_of
from tests.services.chunks import layout, make_chunks


def _obj() -> bytes:
    return make_chunks(1, seed=5)[0][1]


def _geometry(obj: bytes) -> tuple[int, int]:
    return section_size_of(obj[:64]), sections_end_of(obj[-TRAILER_TAIL.size :], len(obj))


def test_a_good_object_passes_every_check():
    obj = _obj()
    size, end = _geometry(obj)
    assert object_problem(obj) == ""
    assert (size, end) == (layout().section_size, layout().sections_size)
    assert range_problem(memoryview(obj), 0, size, end) == ""
    assert range_problem(memoryview(obj)[size : 3 * size], size, size, end) == ""


def test_damage_is_found_by_the_object_and_the_range_checks():
    obj = bytearray(_obj())
    size, end = _geometry(bytes(obj))
    obj[size + 200] ^= 1  # section 1's payload
    assert "layer 1: crc" in object_problem(obj)
    assert "section 1: crc" in range_problem(memoryview(obj), 0, size, end)
    assert range_problem(memoryview(obj)[2 * size : end], 2 * size, size, end) == ""  # sections 2-3 are intact
    assert "crc" in range_problem(memoryview(obj)[size : 2 * size], size, size, end)


def test_non_chunks_are_rejected():
    assert object_problem(b"hello world, not a chunk object") != ""
    assert section_size_of(b"\x00" * 64) == 0
    assert sections_end_of(b"\x00" * TRAILER_TAIL.size, 100) == 0
    assert range_problem(memoryview(b"\x00" * 128), 0, 0, 0) == "not a chunk object"


def test_truncated_object_is_rejected():
    obj = _obj()
    assert object_problem(obj[:-1]) != ""
    assert object_problem(obj[1:]) != ""
