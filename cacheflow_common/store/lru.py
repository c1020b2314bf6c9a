"""A capacity limit with least-recently-used eviction, over any store that can list its entries.

The index (name -> size, oldest first) lives in memory and is rebuilt from the backend when the
store opens, so a pod restarted on the same directory knows every object it acknowledged before
(read recency is not persisted: after a restart the order is the backend's, e.g. write time).
A put makes room first (evicting the oldest objects), then writes; a read hit refreshes recency.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Protocol

from cacheflow_common.errors import ConfigError, StoreError
from cacheflow_common.store.base import ChunkStore


class ListableStore(ChunkStore, Protocol):
    def entries(self) -> list[tuple[str, int]]:
        """(name, size) of every object, least recently used first."""
        ...


class LruStore:
    def __init__(self, inner: ListableStore, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"store capacity must be positive, got {capacity_bytes} bytes")
        self.inner = inner
        self.name = inner.name
        self.capacity_bytes = capacity_bytes
        self.evictions = 0
        self._index: OrderedDict[str, int] = OrderedDict(inner.entries())  # name -> size, oldest first
        self._used = sum(self._index.values())
        self._lock = threading.Lock()
        self._shrink_to(capacity_bytes)  # the limit may have been lowered since the last run

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def object_count(self) -> int:
        return len(self._index)

    def put(self, name: str, data: bytes | memoryview) -> None:
        nbytes = memoryview(data).nbytes
        if nbytes > self.capacity_bytes:
            raise StoreError(f"object {name} ({nbytes} bytes) exceeds the store's capacity ({self.capacity_bytes})")
        with self._lock:
            self._used -= self._index.pop(name, 0)  # a replacement frees the old copy's room
            self._index[name] = nbytes  # room is claimed before the write, so concurrent puts cannot overfill
            self._used += nbytes
        self._shrink_to(self.capacity_bytes)
        try:
            self.inner.put(name, data)
        except BaseException:
            self._forget(name)
            raise

    def _shrink_to(self, limit: int) -> None:
        while True:
            with self._lock:
                if self._used <= limit or not self._index:
                    return
                victim, size = self._index.popitem(last=False)
                self._used -= size
                self.evictions += 1
            self.inner.delete(victim)

    def _forget(self, name: str) -> None:
        with self._lock:
            self._used -= self._index.pop(name, 0)

    def _touch(self, name: str) -> None:
        with self._lock:
            if name in self._index:
                self._index.move_to_end(name)

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        ok = self.inner.read_into(name, buf, offset)
        if ok:
            self._touch(name)
        return ok

    def read(self, name: str) -> bytes | None:
        data = self.inner.read(name)
        if data is not None:
            self._touch(name)
        return data

    def size(self, name: str) -> int | None:
        return self.inner.size(name)

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def delete(self, name: str) -> None:
        self.inner.delete(name)
        self._forget(name)

    def entries(self) -> list[tuple[str, int]]:
        with self._lock:
            return list(self._index.items())
