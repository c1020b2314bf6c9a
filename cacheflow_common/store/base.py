"""The store interface: one value per chunk object, backends chosen by name.

Reads never raise for a miss: an absent, short or unreadable object is `False` / `None`, and the
restore recomputes it. Writes raise `StoreError` when they cannot be completed (durably, where the
backend is durable). Names are checked by `cacheflow_common.kv.keys.valid_name`: a bad name given
to `put` or `delete` is a `BadRequestError`; given to a read, it is simply a miss.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from cacheflow_common.errors import ConfigError


@runtime_checkable
class ChunkStore(Protocol):
    name: str  # the backend, for logs and metrics

    def put(self, name: str, data: bytes | memoryview) -> None:
        """Store (or replace) the object `name`; StoreError on failure."""
        ...

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        """Fill all of `buf` with bytes [offset, offset + len(buf)) of the object; False on a miss."""
        ...

    def read(self, name: str) -> bytes | None:
        """The whole object, or None on a miss."""
        ...

    def size(self, name: str) -> int | None:
        """The object's size in bytes, or None when it is absent."""
        ...

    def exists(self, name: str) -> bool: ...

    def delete(self, name: str) -> None:
        """Remove the object; removing an absent one is not an error."""
        ...


def byte_view(buf: memoryview | bytearray) -> memoryview:
    """`buf` as a flat writable view of bytes (format "B"), whatever its item format or shape."""
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def open_store(spec: str) -> ChunkStore:
    """A store by name: "memory", "filesystem:/path/to/dir" or "redis://host:port/db"; ConfigError otherwise."""
    from cacheflow_common.store.filesystem import FilesystemStore
    from cacheflow_common.store.memory import MemoryStore

    kind, _, arg = spec.partition(":")
    if kind == "memory" and not arg:
        return MemoryStore()
    if kind == "filesystem" and arg:
        return FilesystemStore(Path(arg).expanduser())
    if kind in ("redis", "rediss", "unix") and arg:
        from cacheflow_common.store.redis_store import RedisStore  # the redis client is an optional dependency

        return RedisStore(spec)
    raise ConfigError(f"unknown store {spec!r}: use 'memory', 'filesystem:/path/to/dir' or 'redis://host:port/db'")
