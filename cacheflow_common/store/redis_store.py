"""A Redis backend: one Redis string per chunk object, header and payload together.

Ranged reads use GETRANGE, so layer-wise restore reads one section without fetching the rest.
Redis being down or restarting is a miss for reads and a StoreError for writes, never a crash: the
client reconnects on the next command. Durability and eviction are Redis's own (`appendonly yes`,
`maxmemory` with `allkeys-lru`); configure them on the server.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from cacheflow_common.errors import BadRequestError, StoreError
from cacheflow_common.kv.keys import valid_name
from cacheflow_common.store.base import byte_views, scatter

_FAILURES = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ResponseError)


class RedisStore:
    name = "redis"

    def __init__(self, url: str, *, prefix: str = "cf:", timeout_s: float = 2.0) -> None:
        # No retries inside the client: a read that cannot be answered now is a miss, and the restore moves on.
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = prefix
        self.url = url

    def _key(self, name: str) -> str:
        if not valid_name(name):
            raise BadRequestError(f"invalid object name {name!r}")
        return self.prefix + name

    def put(self, name: str, data: bytes | memoryview) -> None:
        try:
            self.client.set(self._key(name), memoryview(data).cast("B"))  # redis-py sends a view without a copy
        except _FAILURES as exc:
            raise StoreError(f"cannot store {name} in Redis: {exc}") from exc

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        return self.readv_into(name, [buf], offset)

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        out, length = byte_views(views)
        if not valid_name(name) or offset < 0 or not length:
            return False
        try:
            data = self.client.getrange(self.prefix + name, offset, offset + length - 1)
        except _FAILURES:
            return False
        if not isinstance(data, bytes) or len(data) != length:  # absent, or shorter than the range
            return False
        scatter(data, out)
        return True

    def read(self, name: str) -> bytes | None:
        if not valid_name(name):
            return None
        try:
            data = self.client.get(self.prefix + name)
        except _FAILURES:
            return None
        return data if isinstance(data, bytes) else None

    def size(self, name: str) -> int | None:
        if not valid_name(name):
            return None
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.exists(self.prefix + name)
            pipe.strlen(self.prefix + name)
            present, length = pipe.execute()
        except _FAILURES:
            return None
        return int(length) if present else None

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def delete(self, name: str) -> None:
        try:
            self.client.delete(self._key(name))
        except _FAILURES as exc:
            raise StoreError(f"cannot delete {name} from Redis: {exc}") from exc

    def entries(self) -> list[tuple[str, int]]:
        """(name, size) of every object under the prefix (SCAN: fine for tools, not for the hot path)."""
        out = []
        for key in self.client.scan_iter(match=self.prefix + "*", count=1000):
            name = key.decode()[len(self.prefix) :]
            size = self.size(name)
            if size is not None:
                out.append((name, size))
        return out

    def ping(self) -> bool:
        try:
            return bool(self.client.ping())
        except _FAILURES:
            return False
