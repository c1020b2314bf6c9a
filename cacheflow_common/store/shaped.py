"""A store behind an emulated link: reads are shaped by a token bucket; writes pass unshaped by default."""

from __future__ import annotations

import threading

from cacheflow_common.store.base import ChunkStore
from cacheflow_common.transport.shaping import TokenBucket


class ShapedStore:
    def __init__(self, inner: ChunkStore, shaper: TokenBucket, *, shape_writes: bool = False) -> None:
        self.inner = inner
        self.shaper = shaper
        self.shape_writes = shape_writes
        self.name = f"shaped({inner.name})"
        self.bytes_read = 0
        self.misses = 0
        self._lock = threading.Lock()

    def put(self, name: str, data: bytes | memoryview) -> None:
        if self.shape_writes:
            self.shaper.consume(len(data))
        self.inner.put(name, data)

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        deadline = self.shaper.reserve(len(buf))  # the emulated transfer starts now ...
        ok = self.inner.read_into(name, buf, offset)  # ... and overlaps the real read
        self.shaper.wait(deadline)
        self._count(len(buf) if ok else 0, ok)
        return ok

    def read(self, name: str) -> bytes | None:
        data = self.inner.read(name)
        if data is not None:
            self.shaper.consume(len(data))
        self._count(len(data) if data is not None else 0, data is not None)
        return data

    def _count(self, nbytes: int, ok: bool) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.misses += 0 if ok else 1

    def size(self, name: str) -> int | None:
        return self.inner.size(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def delete(self, name: str) -> None:
        self.inner.delete(name)
