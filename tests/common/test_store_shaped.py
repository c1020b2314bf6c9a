"""The shaped store: same bytes as the store it wraps, bookings made before the real read, misses returned at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.shaped import ShapedStore
from cacheflow_common.transport.shaping import TokenBucket


class _Recording(TokenBucket):
    """A bucket that logs what the store asks of it (the link itself is unlimited)."""

    def __init__(self, log: list[tuple[str, object]]) -> None:
        super().__init__(0)
        self.log = log

    def reserve(self, nbytes: int, now: float | None = None) -> float:
        self.log.append(("reserve", nbytes))
        return super().reserve(nbytes, now)

    def wait(self, deadline: float) -> None:
        self.log.append(("wait", None))

    def release(self, deadline: float, nbytes: int) -> bool:
        self.log.append(("release", nbytes))
        return True


class _LoggedMemory(MemoryStore):
    def __init__(self, log: list[tuple[str, object]]) -> None:
        super().__init__()
        self.log = log

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        self.log.append(("read", name))
        return super().readv_into(name, views, offset)


def test_reads_book_the_link_before_reading_and_wait_after():
    log: list[tuple[str, object]] = []
    inner = _LoggedMemory(log)
    inner.put("a", bytes(range(200)))
    shaped = ShapedStore(inner, _Recording(log))
    buf = memoryview(bytearray(50))
    assert shaped.read_into("a", buf, 100) and bytes(buf) == bytes(range(100, 150))
    assert log == [("reserve", 50), ("read", "a"), ("wait", None)]
    log.clear()
    assert not shaped.read_into("b", buf)  # a miss gives its booking back and does not wait
    assert log == [("reserve", 50), ("read", "b"), ("release", 50)]
    assert (shaped.reads, shaped.bytes_read, shaped.misses) == (2, 50, 1)


def test_a_miss_frees_the_link_for_the_next_reader():
    inner = MemoryStore()
    bucket = TokenBucket(1000.0, burst_bytes=0)  # 1 kB/s: a booked 1 kB miss would hold the link for 1 s
    shaped = ShapedStore(inner, bucket)
    assert not shaped.read_into("absent", memoryview(bytearray(1000)))
    assert bucket.reserve(0, now=0.0) <= time.monotonic()  # the link is booked up to the miss, not 1 s beyond it


def test_whole_reads_writes_and_counts():
    log: list[tuple[str, object]] = []
    inner = MemoryStore()
    shaped = ShapedStore(inner, _Recording(log))
    shaped.put("x", b"y" * 300)
    assert log == [] and shaped.bytes_written == 300  # writes are not shaped by default
    assert shaped.read("x") == b"y" * 300 and shaped.read("nope") is None
    assert log == [("reserve", 300), ("wait", None)]
    assert (shaped.reads, shaped.bytes_read, shaped.misses) == (2, 300, 1)
    assert shaped.size("x") == 300 and shaped.exists("x") and shaped.name == "shaped(memory)"
    shaped.delete("x")
    assert not inner.exists("x")
    log.clear()
    writing = ShapedStore(inner, _Recording(log), shape_writes=True)
    writing.put("z", memoryview(b"q" * 70))
    assert log == [("reserve", 70), ("wait", None)] and inner.read("z") == b"q" * 70


def test_concurrent_reads_count_every_byte():
    inner = MemoryStore()
    for i in range(8):
        inner.put(f"o{i}", bytes([i]) * 4096)
    shaped = ShapedStore(inner, TokenBucket(0))
    bad: list[int] = []

    def reader(i: int) -> None:
        buf = memoryview(bytearray(4096))
        for _ in range(50):
            if not shaped.read_into(f"o{i}", buf) or bytes(buf) != bytes([i]) * 4096:
                bad.append(i)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == [] and shaped.reads == 400 and shaped.bytes_read == 400 * 4096 and shaped.misses == 0
