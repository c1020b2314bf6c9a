"""The store interface: one value per chunk object, backends chosen by name.

Reads never raise for a miss: an absent, short or unreadable object is `False` / `None`, and the
restore recomputes it. Writes raise `StoreError` when they cannot be completed (durably, where the
backend is durable). Names are checked by `cacheflow_common.kv.keys.valid_name`: a bad name given
to `put` or `delete` is a `BadRequestError`; given to a read, it is simply a miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from cacheflow_common.errors import ConfigError

IOV_MAX = 1024  # buffers one readv / recvmsg may fill (Linux's limit)


@runtime_checkable
class ChunkStore(Protocol):
    name: str  # the backend, for logs and metrics

    def put(self, name: str, data: bytes | memoryview) -> None:
        """Store (or replace) the object `name`; StoreError on failure."""
        ...

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        """Fill all of `buf` with bytes [offset, offset + len(buf)) of the object; False on a miss."""
        ...

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        """`read_into` scattered: the object's bytes from `offset` on fill `views` one after another (the
        reader's own buffers, e.g. rows of a KV buffer: no copy through a staging buffer); False on a miss,
        after which the views may hold part of the bytes."""
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


def byte_views(views: Sequence[memoryview]) -> tuple[list[memoryview], int]:
    """`views` as flat byte views, and their total length."""
    flat = [byte_view(v) for v in views]
    return flat, sum(len(v) for v in flat)


def views_after(views: Sequence[memoryview], skip: int) -> list[memoryview]:
    """What is left of `views` once their first `skip` bytes are filled."""
    for i, view in enumerate(views):
        if skip < len(view):
            return [view[skip:], *views[i + 1 :]]
        skip -= len(view)
    return []


def views_within(views: Sequence[memoryview], start: int, length: int) -> list[memoryview]:
    """The parts of `views` (taken one after another) that hold bytes [start, start + length)."""
    out = []
    for view in views_after(views, start):
        if length <= 0:
            break
        out.append(view[:length])
        length -= len(out[-1])
    return out


def scatter(data: memoryview | bytes, views: Sequence[memoryview]) -> None:
    """Copy `data` into `views` one after another (they hold exactly its length)."""
    src, at = memoryview(data).cast("B"), 0
    for view in views:
        view[:] = src[at : at + len(view)]
        at += len(view)


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
