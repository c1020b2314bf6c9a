"""The store interface: one value per chunk object, chosen by name in config.

Reads never raise for a miss: an absent, short or unreadable object is `False` / `None`, and the
restore recomputes it. Writes raise `StoreError` when they cannot be made durable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from cacheflow_common.errors import ConfigError


class ChunkStore(Protocol):
    name: str

    def put(self, name: str, data: bytes | memoryview) -> None: ...

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        """Fill all of `buf` with bytes [offset, offset + len(buf)) of the object; False on a miss."""
        ...

    def read(self, name: str) -> bytes | None: ...

    def size(self, name: str) -> int | None: ...

    def exists(self, name: str) -> bool: ...

    def delete(self, name: str) -> None: ...


def open_store(spec: str) -> ChunkStore:
    """`memory` or `filesystem:/a/dir`."""
    from cacheflow_common.store.filesystem import FilesystemStore
    from cacheflow_common.store.memory import MemoryStore

    kind, _, arg = spec.partition(":")
    if kind == "memory" and not arg:
        return MemoryStore()
    if kind == "filesystem" and arg:
        return FilesystemStore(Path(arg).expanduser())
    raise ConfigError(f"unknown store {spec!r}: use 'memory' or 'filesystem:/path/to/dir'")
