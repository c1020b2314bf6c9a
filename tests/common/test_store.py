"""Stores: the filesystem backend's durability and reads, the memory backend, and the shaped wrapper."""

from __future__ import annotations

import threading

import pytest

from cacheflow_common.errors import BadRequestError, ConfigError
from cacheflow_common.store.base import open_store
from cacheflow_common.store.filesystem import FilesystemStore
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.shaped import ShapedStore
from cacheflow_common.transport.shaping import TokenBucket


@pytest.fixture(params=["memory", "filesystem"])
def store(request, tmp_path):
    return MemoryStore() if request.param == "memory" else FilesystemStore(tmp_path / "s")


def test_put_read_ranges_and_delete(store):
    data = bytes(range(256)) * 40
    store.put("obj-1", data)
    assert store.read("obj-1") == data and store.size("obj-1") == len(data) and store.exists("obj-1")
    buf = memoryview(bytearray(100))
    assert store.read_into("obj-1", buf, 1000) and bytes(buf) == data[1000:1100]
    assert not store.read_into("obj-1", memoryview(bytearray(100)), len(data) - 50)  # short: a miss
    assert not store.read_into("absent", buf) and store.read("absent") is None and store.size("absent") is None
    store.put("obj-1", b"new")  # overwrite
    assert store.read("obj-1") == b"new"
    store.delete("obj-1")
    assert not store.exists("obj-1")
    store.delete("obj-1")  # deleting twice is fine


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", ".", "x" * 300, "sp ace"])
def test_bad_names_are_rejected(store, bad):
    with pytest.raises(BadRequestError):
        store.put(bad, b"x")
    assert store.read(bad) is None and not store.read_into(bad, memoryview(bytearray(1)))


def test_filesystem_survives_reopen_and_leaves_no_temp_files(tmp_path):
    root = tmp_path / "s"
    first = FilesystemStore(root)
    for i in range(20):
        first.put(f"obj-{i}", bytes([i]) * (i + 1))
    again = FilesystemStore(root)
    assert all(again.read(f"obj-{i}") == bytes([i]) * (i + 1) for i in range(20))
    assert not [p for p in root.rglob(".tmp-*")]


def test_concurrent_readers_see_whole_objects(tmp_path):
    store = FilesystemStore(tmp_path / "s")
    blobs = {f"o{i}": bytes([i]) * 100_000 for i in range(8)}
    for k, v in blobs.items():
        store.put(k, v)
    bad: list[str] = []

    def reader(name: str) -> None:
        buf = memoryview(bytearray(100_000))
        for _ in range(20):
            if not store.read_into(name, buf) or bytes(buf) != blobs[name]:
                bad.append(name)

    threads = [threading.Thread(target=reader, args=(k,)) for k in blobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


def test_open_store_by_name(tmp_path):
    assert isinstance(open_store("memory"), MemoryStore)
    assert isinstance(open_store(f"filesystem:{tmp_path}"), FilesystemStore)
    with pytest.raises(ConfigError):
        open_store("tape:/dev/st0")


def test_shaped_store_returns_the_same_bytes_and_counts():
    inner = MemoryStore()
    inner.put("a", b"x" * 1000)
    shaped = ShapedStore(inner, TokenBucket(1e9))
    buf = memoryview(bytearray(1000))
    assert shaped.read_into("a", buf) and bytes(buf) == b"x" * 1000
    assert not shaped.read_into("b", buf)
    assert shaped.bytes_read == 1000 and shaped.misses == 1


def test_readv_into_scatters_a_range_over_many_buffers(store):
    data = bytes(range(256)) * 40
    store.put("obj-1", data)
    sizes = [1, 7, 64, 0, 300] + [2] * 1500  # more buffers than one readv takes (IOV_MAX, 1024)
    views = [memoryview(bytearray(n)) for n in sizes]
    assert store.readv_into("obj-1", views, 100)
    assert b"".join(bytes(v) for v in views) == data[100 : 100 + sum(sizes)]
    assert not store.readv_into("obj-1", [memoryview(bytearray(60))] * 2, len(data) - 100)  # short: a miss
    assert not store.readv_into("absent", views)
