"""An in-process store: a dict of immutable bytes (tests, benchmarks, and a cache tier)."""

from __future__ import annotations

import threading

from cacheflow_common.errors import BadRequestError
from cacheflow_common.kv.keys import valid_name


class MemoryStore:
    name = "memory"

    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, name: str, data: bytes | memoryview) -> None:
        if not valid_name(name):
            raise BadRequestError(f"invalid object name {name!r}")
        with self._lock:
            self._objects[name] = bytes(data)

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        with self._lock:
            obj = self._objects.get(name)
        if obj is None or offset < 0 or offset + len(buf) > len(obj):
            return False
        buf[:] = memoryview(obj)[offset : offset + len(buf)]
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
        with self._lock:
            self._objects.pop(name, None)
