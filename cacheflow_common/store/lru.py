"""A capacity limit with least-recently-used eviction, over any store that can list its entries.

The index (name -> size, oldest first) lives in memory and is rebuilt from the backend when the
store opens, so a pod restarted on the same directory knows every object it acknowledged before
(read recency is not persisted: after a restart the order is the backend's, e.g. write time).
A put makes room first (evicting the oldest objects), then writes; a read hit refreshes recency.
Evictions and deletes remove the object from the backend under the index's lock, in one step with
taking it out of the index: a put of the same name (a replacement) comes wholly before or after, so
it is never deleted by an eviction or delete that began before it (it was: an evicted chunk rewritten
at once could be deleted afterwards, by the eviction still under way, and stay missing).

Owners and shares (a storage pod's tenants): with `owner_of` (name -> owner) and `shares` (owner ->
bytes it is guaranteed), each owner keeps its own LRU order. Capacity that an owner does not use may
be borrowed by the others, so one busy owner can fill an idle store; when room is needed, the objects
go in this order: the writer's own oldest objects while the writer is over its share, then those of
the owner furthest over its share, and only when nobody is over (shares that add up to more than the
capacity) the oldest object of all. An owner within its share therefore never loses an object to
another owner's writes. Without `owner_of`, every object has one owner whose share is the capacity:
plain LRU.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from cacheflow_common.errors import ConfigError, StoreError
from cacheflow_common.store.base import ChunkStore


class ListableStore(ChunkStore, Protocol):
    def entries(self) -> list[tuple[str, int]]:
        """(name, size) of every object, least recently used first."""
        ...


def _one_owner(_: str) -> str:
    return ""


class LruStore:
    def __init__(self, inner: ListableStore, capacity_bytes: int, *,
                 owner_of: Callable[[str], str] | None = None, shares: Mapping[str, int] | None = None) -> None:
        if capacity_bytes <= 0:
            raise ConfigError(f"store capacity must be positive, got {capacity_bytes} bytes")
        self.inner = inner
        self.name = inner.name
        self.capacity_bytes = capacity_bytes
        self.owner_of = owner_of or _one_owner
        self.shares = dict(shares or {}) if owner_of is not None else {"": capacity_bytes}
        self.evictions = 0
        self._ticks = itertools.count()  # recency across owners: a larger tick was used more recently
        self._groups: dict[str, OrderedDict[str, tuple[int, int]]] = {}  # owner -> name -> (size, tick), oldest first
        self._used: dict[str, int] = {}
        self._total = 0
        self._count = 0
        self._evicted: dict[str, int] = {}
        self._lock = threading.Lock()
        for name, size in inner.entries():
            self._claim(name, size)
        self._shrink(None, "")  # the limit may have been lowered since the last run

    # ------------------------------------------------------------------------------------ accounting
    @property
    def used_bytes(self) -> int:
        return self._total

    @property
    def object_count(self) -> int:
        return self._count

    def usage(self, owner: str) -> tuple[int, int, int]:
        """(objects, bytes, objects evicted) of one owner."""
        with self._lock:
            return len(self._groups.get(owner, ())), self._used.get(owner, 0), self._evicted.get(owner, 0)

    def _claim(self, name: str, size: int) -> str:
        """Add (or replace) `name` as the newest object of its owner; under the lock or before sharing."""
        owner = self.owner_of(name)
        self._release(owner, name)
        self._groups.setdefault(owner, OrderedDict())[name] = (size, next(self._ticks))
        self._used[owner] = self._used.get(owner, 0) + size
        self._total += size
        self._count += 1
        return owner

    def _release(self, owner: str, name: str) -> None:
        group = self._groups.get(owner)
        if group is not None and name in group:
            size = group.pop(name)[0]
            self._used[owner] -= size
            self._total -= size
            self._count -= 1

    # ------------------------------------------------------------------------------------ eviction
    def _over_share(self, owner: str) -> int:
        return self._used.get(owner, 0) - self.shares.get(owner, 0)

    def _victim(self, writer: str | None, keep: str) -> tuple[str, str] | None:
        """(owner, name) to evict next, never `keep` (the object being written); under the lock.

        `writer`: the owner writing (None: shrinking at start). None when the only way to make room
        would take an object from an owner within its share for a writer over its own.
        """
        def oldest(owner: str) -> str | None:
            return next((n for n in self._groups.get(owner, {}) if n != keep), None)

        over = sorted(((self._over_share(o), o != writer, o) for o in self._used if self._over_share(o) > 0),
                      key=lambda t: (t[1], -t[0]))  # the writer first, then the owner furthest over its share
        for _, _, owner in over:
            name = oldest(owner)
            if name is not None:
                return owner, name
        if writer is not None and self._over_share(writer) > 0:
            return None
        candidates = [(group[n][1], o, n) for o, group in self._groups.items() if (n := oldest(o)) is not None]
        return min(candidates)[1:] if candidates else None  # shares add up to more than the capacity

    def _shrink(self, writer: str | None, keep: str) -> bool:
        """Evict until the store fits its capacity; False, evicting nothing, when it cannot (see `_victim`)."""
        with self._lock:
            victims = self._take_victims(writer, keep)
            for name in victims or ():
                self.inner.delete(name)  # under the lock: see the module's docstring
        return victims is not None

    def _take_victims(self, writer: str | None, keep: str) -> list[str] | None:
        """Take the objects to evict out of the index (under the lock); None, the index unchanged, when
        the store cannot be brought within its capacity."""
        taken: list[tuple[str, str, int, int]] = []  # (owner, name, size, tick)
        while self._total > self.capacity_bytes:
            victim = self._victim(writer, keep)
            if victim is None:
                for owner, name, size, tick in reversed(taken):  # put them back, oldest first again
                    self._groups[owner][name] = (size, tick)
                    self._groups[owner].move_to_end(name, last=False)
                    self._used[owner] += size
                    self._total += size
                    self._count += 1
                return None
            owner, name = victim
            size, tick = self._groups[owner][name]
            self._release(owner, name)
            taken.append((owner, name, size, tick))
        for owner, _, _, _ in taken:
            self.evictions += 1
            self._evicted[owner] = self._evicted.get(owner, 0) + 1
        return [name for _, name, _, _ in taken]

    def _forget(self, name: str) -> None:
        with self._lock:
            self._release(self.owner_of(name), name)

    def _touch(self, name: str) -> None:
        with self._lock:
            group = self._groups.get(self.owner_of(name))
            if group is not None and name in group:
                group[name] = (group.pop(name)[0], next(self._ticks))

    # ------------------------------------------------------------------------------------ ChunkStore
    def put(self, name: str, data: bytes | memoryview) -> None:
        nbytes = memoryview(data).nbytes
        if nbytes > self.capacity_bytes:
            raise StoreError(f"object {name} ({nbytes} bytes) exceeds the store's capacity ({self.capacity_bytes})")
        with self._lock:  # room is claimed before the write (a replacement frees the old copy's room first)
            writer = self._claim(name, nbytes)
        if not self._shrink(writer, name):
            self._forget(name)
            raise StoreError(f"no room for {name}: its owner is over its share of the capacity and every "
                             "other owner is within theirs")
        try:
            self.inner.put(name, data)
        except BaseException:
            self._forget(name)
            raise

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        return self.readv_into(name, [buf], offset)

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        ok = self.inner.readv_into(name, views, offset)
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
        with self._lock:
            self.inner.delete(name)
            self._release(self.owner_of(name), name)

    def entries(self) -> list[tuple[str, int]]:
        with self._lock:
            ordered = sorted((tick, name, size) for g in self._groups.values() for name, (size, tick) in g.items())
        return [(name, size) for _, name, size in ordered]
