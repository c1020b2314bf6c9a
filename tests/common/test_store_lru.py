"""Capacity limits with LRU eviction, over memory and over a filesystem directory that outlives the store."""

from __future__ import annotations

import threading

import pytest

from cacheflow_common.errors import ConfigError, StoreError
from cacheflow_common.store.filesystem import FilesystemStore
from cacheflow_common.store.lru import LruStore
from cacheflow_common.store.memory import MemoryStore


def _names(n: int) -> list[str]:
    return [f"obj{i:03d}" for i in range(n)]


def test_evicts_least_recently_used_first():
    store = LruStore(MemoryStore(), capacity_bytes=300)
    a, b, c, d = _names(4)
    for name in (a, b, c):
        store.put(name, b"x" * 100)
    assert store.read(a) is not None  # a is now the most recent
    store.put(d, b"x" * 100)
    assert [store.exists(n) for n in (a, b, c, d)] == [True, False, True, True]
    assert store.evictions == 1 and store.used_bytes == 300


def test_replacing_an_object_counts_its_new_size_only():
    store = LruStore(MemoryStore(), capacity_bytes=250)
    store.put("one", b"x" * 100)
    store.put("one", b"y" * 200)
    assert store.used_bytes == 200 and store.evictions == 0 and store.read("one") == b"y" * 200


def test_an_object_larger_than_the_capacity_is_refused():
    store = LruStore(MemoryStore(), capacity_bytes=10)
    with pytest.raises(StoreError, match="exceeds"):
        store.put("big", b"x" * 11)
    with pytest.raises(ConfigError):
        LruStore(MemoryStore(), capacity_bytes=0)


def test_index_is_rebuilt_from_the_directory_and_a_lower_limit_applies(tmp_path):
    store = LruStore(FilesystemStore(tmp_path), capacity_bytes=1000)
    for name in _names(5):
        store.put(name, b"z" * 100)
    reopened = LruStore(FilesystemStore(tmp_path), capacity_bytes=1000)
    assert reopened.object_count == 5 and reopened.used_bytes == 500
    smaller = LruStore(FilesystemStore(tmp_path), capacity_bytes=300)
    assert smaller.object_count == 3 and smaller.evictions == 2
    assert sorted(FilesystemStore(tmp_path).names()) == _names(5)[2:]  # the oldest writes went first


def test_delete_frees_room():
    store = LruStore(MemoryStore(), capacity_bytes=200)
    store.put("a1", b"x" * 200)
    store.delete("a1")
    store.put("b1", b"x" * 200)
    assert store.evictions == 0 and store.used_bytes == 200


class _PausingStore(MemoryStore):
    """A memory store whose first delete of `name` waits until `release` is set (after setting `entered`)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.pause_on = name
        self.entered = threading.Event()
        self.release = threading.Event()

    def delete(self, name: str) -> None:
        if name == self.pause_on and not self.entered.is_set():
            self.entered.set()
            self.release.wait(60)
        super().delete(name)


def test_an_object_rewritten_while_its_eviction_is_under_way_stays():
    x, z, y = _names(3)
    inner = _PausingStore(x)
    store = LruStore(inner, 200)
    store.put(x, b"a" * 100)
    store.put(z, b"b" * 100)
    evicting = threading.Thread(target=store.put, args=(y, b"c" * 100))  # evicts x, the oldest
    evicting.start()
    assert inner.entered.wait(60)  # x is out of the index, its delete under way
    rewrite = threading.Thread(target=store.put, args=(x, b"d" * 100))  # x written again (found missing, say)
    rewrite.start()
    rewrite.join(timeout=2)  # unfixed, the rewrite ends here, and the eviction then deletes the new x
    inner.release.set()
    evicting.join(60)
    rewrite.join(60)
    assert store.read(x) == b"d" * 100
    assert sorted(name for name, _ in store.entries()) == inner.names()  # the index and the backend agree
