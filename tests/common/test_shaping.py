"""The token bucket's arithmetic, checked on the deadlines it returns (never on wall-clock time)."""

from __future__ import annotations

import threading

from cacheflow_common.transport.shaping import TokenBucket, gbps


def test_back_to_back_reservations_add_up_to_bytes_over_rate():
    bucket = TokenBucket(1000.0, burst_bytes=0)
    d1 = bucket.reserve(500, now=10.0)
    d2 = bucket.reserve(1500, now=10.0)
    assert d1 == 10.5 and d2 == 12.0


def test_idle_link_credits_at_most_one_burst():
    bucket = TokenBucket(1000.0, burst_bytes=100)
    assert bucket.reserve(100, now=50.0) == 50.0  # a full bucket passes one burst at once
    assert bucket.reserve(1000, now=50.0) == 51.0  # then the rate applies


def test_concurrent_readers_share_the_link_in_arrival_order():
    bucket = TokenBucket(1e6, burst_bytes=0)
    deadlines: list[float] = []
    lock = threading.Lock()

    def reader() -> None:
        for _ in range(50):
            d = bucket.reserve(1000, now=0.0)
            with lock:
                deadlines.append(d)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # 200 reservations of 1 ms each, none overlapping: exactly the link's capacity.
    assert abs(max(deadlines) - 0.2) < 1e-9 and len(set(deadlines)) == 200


def test_unlimited_and_units():
    assert TokenBucket(0).reserve(10**12, now=3.0) == 3.0
    assert gbps(8) == 1e9
