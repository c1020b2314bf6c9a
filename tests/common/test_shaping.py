"""The token bucket's arithmetic, checked on the deadlines it returns (never on wall-clock time)."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest

from cacheflow_common.errors import BadRequestError
from cacheflow_common.transport.shaping import TokenBucket, gbps


def test_back_to_back_reservations_add_up_to_bytes_over_rate():
    bucket = TokenBucket(1000.0, burst_bytes=0)
    d1 = bucket.reserve(500, now=10.0)
    d2 = bucket.reserve(1500, now=10.0)
    d3 = bucket.reserve(0, now=10.0)
    assert d1 == 10.5 and d2 == 12.0 and d3 == 12.0
    # A reservation made after the link went idle starts when it is made.
    assert bucket.reserve(1000, now=20.0) == 21.0


def test_idle_link_credits_at_most_one_burst():
    bucket = TokenBucket(1000.0, burst_bytes=100)
    assert bucket.reserve(100, now=50.0) == 50.0  # a full bucket passes one burst at once
    assert bucket.reserve(1000, now=50.0) == 51.0  # then the rate applies
    assert bucket.reserve(300, now=100.0) == pytest.approx(100.2)  # idle again: one burst (0.1 s) credited


def test_concurrent_readers_tile_the_link_in_arrival_order():
    rate = 1e6
    bucket = TokenBucket(rate, burst_bytes=0)
    booked: list[tuple[float, int]] = []
    per_thread: dict[int, list[float]] = {}
    lock = threading.Lock()

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[float] = []
        for _ in range(100):
            n = rng.randrange(1, 5000)
            d = bucket.reserve(n, now=0.0)
            mine.append(d)
            with lock:
                booked.append((d, n))
        per_thread[seed] = mine

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    booked.sort()
    # No overlap and no gap: each booking ends exactly its own bytes after the one before it.
    end = 0.0
    for deadline, n in booked:
        assert deadline == pytest.approx(end + n / rate, abs=1e-9)
        end = deadline
    assert end == pytest.approx(sum(n for _, n in booked) / rate)
    assert all(mine == sorted(mine) and len(set(mine)) == len(mine) for mine in per_thread.values())


def test_release_gives_back_only_the_last_booking():
    bucket = TokenBucket(1000.0, burst_bytes=0)
    d1 = bucket.reserve(500, now=0.0)
    assert bucket.release(d1, 500)
    assert bucket.reserve(100, now=0.0) == pytest.approx(0.1)  # the link is free again
    d2 = bucket.reserve(100, now=0.0)
    bucket.reserve(100, now=0.0)
    assert not bucket.release(d2, 100)  # someone is queued behind it: deadlines stay as promised
    assert bucket.reserve(0, now=0.0) == pytest.approx(0.3)


def test_unlimited_links_and_bad_arguments():
    for rate in (0, -5, math.inf):
        bucket = TokenBucket(rate)
        assert bucket.unlimited and bucket.reserve(10**12, now=3.0) == 3.0
        bucket.consume(10**12)  # returns at once: nothing to wait for
    with pytest.raises(BadRequestError):
        TokenBucket(math.nan)
    with pytest.raises(BadRequestError):
        TokenBucket(1e6, burst_bytes=-1)
    with pytest.raises(BadRequestError):
        TokenBucket(1e6).reserve(-1)


def test_real_clock_reservations_are_in_the_future_and_waits_return():
    bucket = TokenBucket(gbps(80))
    before = time.monotonic()
    deadline = bucket.reserve(10_000_000)  # 1 ms at 80 Gbit/s, less one burst
    assert deadline >= before
    bucket.wait(deadline)
    assert time.monotonic() >= deadline  # wait() returns no earlier than the deadline
    bucket.wait(before - 1.0)  # a past deadline: no sleep


def test_units():
    assert gbps(8) == 1e9
    assert gbps(10) == 1.25e9
