"""The filesystem store: atomic durable writes, reads straight into any buffer, names that cannot escape the root.

(The behaviour both backends share is covered in test_store.py.)
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from cacheflow_common.errors import BadRequestError, StoreError
from cacheflow_common.store.base import ChunkStore, open_store
from cacheflow_common.store.filesystem import FilesystemStore
from cacheflow_common.store.memory import MemoryStore


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.startswith(".")]


def test_both_backends_satisfy_the_protocol(tmp_path):
    assert isinstance(FilesystemStore(tmp_path), ChunkStore) and isinstance(MemoryStore(), ChunkStore)
    assert isinstance(open_store(f"filesystem:{tmp_path}/x"), FilesystemStore)


def test_objects_are_sharded_and_survive_a_new_instance(tmp_path):
    root = tmp_path / "s"
    data = os.urandom(300_000)
    FilesystemStore(root).put("ab12.kv.L0-4", memoryview(data))
    assert (root / "ab" / "ab12.kv.L0-4").read_bytes() == data
    again = FilesystemStore(root)
    buf = bytearray(1000)
    assert again.read_into("ab12.kv.L0-4", memoryview(buf), 123_456) and bytes(buf) == data[123_456:124_456]
    assert again.size("ab12.kv.L0-4") == len(data) and list(again.names()) == ["ab12.kv.L0-4"]


@pytest.mark.parametrize("bad", ["...", "..", ".tmp-abc", "../../x", "/etc/passwd", "a\n", "x" * 201])
def test_names_cannot_escape_the_root_or_collide_with_temp_files(tmp_path, bad):
    root = tmp_path / "inner" / "s"
    store = FilesystemStore(root)
    with pytest.raises(BadRequestError):
        store.put(bad, b"x")
    with pytest.raises(BadRequestError):
        store.delete(bad)
    assert store.read(bad) is None and store.size(bad) is None and not store.exists(bad)
    assert not store.read_into(bad, memoryview(bytearray(1)))
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["inner", "s"]  # nothing written anywhere


def test_read_into_fills_any_flat_buffer(tmp_path):
    store = FilesystemStore(tmp_path)
    values = np.arange(1000, dtype=np.float32)  # [1000]
    store.put("floats", values.tobytes())
    out = np.zeros(1000, dtype=np.float32)
    assert store.read_into("floats", out.data) and np.array_equal(out, values)
    tensor = torch.zeros(10, 25, dtype=torch.bfloat16)  # [10, 25]: 500 bytes
    assert store.read_into("floats", tensor.view(torch.uint8).numpy().data, 4 * 100)
    assert tensor.view(torch.uint8).numpy().tobytes() == values[100:225].tobytes()
    assert store.read_into("floats", memoryview(bytearray(0)), 4000)  # an empty read at the end is fine
    assert not store.read_into("floats", memoryview(bytearray(1)), -1)
    assert not store.read_into("floats", memoryview(bytearray(1)), 4000)


def test_short_reads_are_resumed(tmp_path, monkeypatch):
    store = FilesystemStore(tmp_path)
    data = os.urandom(10_000)
    store.put("obj", data)
    real = os.preadv
    calls = []

    def dribble(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append(offset)
        return real(fd, [buffers[0][:777]], offset)  # the kernel may return less than asked

    monkeypatch.setattr(os, "preadv", dribble)
    buf = memoryview(bytearray(9000))
    assert store.read_into("obj", buf, 500) and bytes(buf) == data[500:9500]
    assert len(calls) == 12


def test_failed_write_raises_store_error_keeps_the_old_object_and_no_temp_file(tmp_path, monkeypatch):
    store = FilesystemStore(tmp_path)
    store.put("obj", b"old")

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(StoreError):
        store.put("obj", b"new")
    monkeypatch.undo()
    assert store.read("obj") == b"old" and _temp_files(tmp_path) == []


def test_interrupted_write_leaves_no_temp_file(tmp_path, monkeypatch):
    store = FilesystemStore(tmp_path)
    store.put("ob-other", b"x")  # the shard directory exists: the interruption hits the object's own fsync

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.put("obj", b"data")
    monkeypatch.undo()
    assert not store.exists("obj") and _temp_files(tmp_path) == []


def test_readers_see_the_old_or_the_new_object_never_a_mix(tmp_path):
    store = FilesystemStore(tmp_path)
    size = 1 << 20
    versions = [bytes([v]) * size for v in range(4)]
    store.put("hot", versions[0])
    stop = threading.Event()
    seen: list[int] = []
    torn: list[int] = []

    def writer() -> None:
        for i in range(40):
            store.put("hot", versions[i % 4])
        stop.set()

    def reader() -> None:
        buf = np.zeros(size, dtype=np.uint8)
        while not stop.is_set():
            if not store.read_into("hot", buf.data):
                torn.append(-1)  # an object being replaced must never read as absent
            first = int(buf[0])
            (seen if bool((buf == first).all()) else torn).append(first)

    threads = [threading.Thread(target=writer), *(threading.Thread(target=reader) for _ in range(3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torn == [] and seen and _temp_files(tmp_path) == []


def test_delete_and_names(tmp_path):
    store = FilesystemStore(tmp_path)
    for name in ("b-2", "a-1", "ff.kv.L0-2"):
        store.put(name, name.encode())
    assert list(store.names()) == ["a-1", "b-2", "ff.kv.L0-2"]
    store.delete("b-2")
    store.delete("b-2")  # absent: fine
    assert list(store.names()) == ["a-1", "ff.kv.L0-2"] and store.read("b-2") is None
