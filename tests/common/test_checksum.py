"""Chunk checksums: the fast CRC-32 gives zlib's values, so chunks written with either read back with the other."""

from __future__ import annotations

import zlib

import numpy as np

from cacheflow_common.kv import checksum


def test_the_fast_crc_is_zlibs_crc32_whole_and_chained():
    data = np.random.default_rng(0).integers(0, 255, 3 << 20, dtype=np.uint8).data
    assert checksum.crc32 is not zlib.crc32  # isal is a dependency: the fast one is in use
    assert checksum.crc32(data) == zlib.crc32(data)
    assert checksum.crc32(data[1000:], checksum.crc32(data[:1000])) == zlib.crc32(data)
    assert checksum.crc32(b"") == 0
