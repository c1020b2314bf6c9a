"""A store behind an emulated link: reads are shaped by a token bucket; writes pass unshaped by default.

A read books its bytes on the link first, then does the real read, then sleeps until the booking's
deadline: the real read overlaps the emulated transfer, so a read costs max(real, nbytes / rate)
rather than their sum. A miss returns at once (the store would answer "absent" without sending the
bytes) and gives its booking back when no later read is queued behind it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from cacheflow_common.store.base import ChunkStore
from cacheflow_common.transport.shaping import TokenBucket


class ShapedStore:
    def __init__(self, inner: ChunkStore, shaper: TokenBucket, *, shape_writes: bool = False) -> None:
        self.inner = inner
        self.shaper = shaper
        self.shape_writes = shape_writes  # off by default: restores read, saves happen off the critical path
        self.name = f"shaped({inner.name})"
        self.reads = 0
        self.bytes_read = 0
        self.misses = 0
        self.bytes_written = 0
        self._lock = threading.Lock()

    def put(self, name: str, data: bytes | memoryview) -> None:
        nbytes = memoryview(data).nbytes
        deadline = self.shaper.reserve(nbytes) if self.shape_writes else 0.0
        self.inner.put(name, data)
        if self.shape_writes:
            self.shaper.wait(deadline)
        with self._lock:
            self.bytes_written += nbytes

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        return self.readv_into(name, [buf], offset)

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        nbytes = sum(memoryview(v).nbytes for v in views)
        deadline = self.shaper.reserve(nbytes)  # the emulated transfer starts now ...
        ok = self.inner.readv_into(name, views, offset)  # ... and overlaps the real read
        if ok:
            self.shaper.wait(deadline)
        else:
            self.shaper.release(deadline, nbytes)
        self._count(nbytes if ok else 0, ok)
        return ok

    def read(self, name: str) -> bytes | None:
        started = time.monotonic()  # the size is known only after the read: book it from when the read began
        data = self.inner.read(name)
        if data is not None:
            self.shaper.wait(self.shaper.reserve(len(data), now=started))
        self._count(len(data) if data is not None else 0, data is not None)
        return data

    def _count(self, nbytes: int, ok: bool) -> None:
        with self._lock:
            self.reads += 1
            self.bytes_read += nbytes
            self.misses += 0 if ok else 1

    def size(self, name: str) -> int | None:
        return self.inner.size(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def delete(self, name: str) -> None:
        self.inner.delete(name)
