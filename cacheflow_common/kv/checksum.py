"""CRC-32 of chunk sections (zlib's polynomial, the value stored in every section header) at memory speed.

ISA-L's implementation (`isal`, a dependency) runs at 15-20 GB/s here, zlib's at 2 GB/s, which made
the two checks of every load (the pod's before it sends, the reader's before it lands) cost more CPU
than moving the bytes. Both release the GIL on large buffers, and give identical values: chunks written
with either read back with the other. Without `isal` (an install with --no-deps), zlib's is used.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Callable

log = logging.getLogger(__name__)


def _fastest() -> Callable[..., int]:
    try:
        from isal import isal_zlib
    except ImportError:
        log.warning("isal is not installed: chunk checksums use zlib's CRC-32 (about 8x slower; pip install isal)")
        return zlib.crc32
    return isal_zlib.crc32


crc32: Callable[..., int] = _fastest()  # crc32(data, value=0) -> int, as zlib.crc32
