"""An in-process store: a dict of immutable bytes (tests, benchmarks, and a cache tier). Thread-safe."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from cacheflow_common.errors import BadRequestError
from cacheflow_common.kv.keys import valid_name
from cacheflow_common.store.base import byte_views, scatter


class MemoryStore:
    name = "memory"

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, name: str, data: bytes | memoryview) -> None:
        if not valid_name(name):
            raise BadRequestError(f"invalid object name {name!r}")
        obj = bytes(data)  # a private copy: later changes to the caller's buffer do not reach the store
        with self._lock:
            self._objects.pop(name, None)  # a replaced object counts as newest
            self._objects[name] = obj

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        return self.readv_into(name, [buf], offset)

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        with self._lock:
            obj = self._objects.get(name)
        out, length = byte_views(views)
        if obj is None or offset < 0 or offset + length > len(obj):
            return False
        scatter(memoryview(obj)[offset : offset + length], out)  # bytes are immutable: no lock needed to copy
        return True

    def read(self, name: str) -> bytes | None:
        with self._lock:
            return self._objects.get(name)

    def size(self, name: str) -> int | None:
        obj = self.read(name)
        return None if obj is None else len(obj)

    def exists(self, name: str) -> bool:
        with self._lock:
            return name in self._objects

    def delete(self, name: str) -> None:
        if not valid_name(name):
            raise BadRequestError(f"invalid object name {name!r}")
        with self._lock:
            self._objects.pop(name, None)

    def entries(self) -> list[tuple[str, int]]:
        """(name, size) of every object, oldest first."""
        with self._lock:
            return [(name, len(obj)) for name, obj in self._objects.items()]

    def names(self) -> list[str]:
        """Every stored name (tests and tools)."""
        with self._lock:
            return sorted(self._objects)
