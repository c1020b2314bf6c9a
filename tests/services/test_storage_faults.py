"""Faults with real processes: killed pods, restarted pods, a restarted Redis, capacity eviction."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from cacheflow_common.errors import StoreError
from tests.services.chunks import big_chunk, make_chunks
from tests.services.procs import redis_server, start_pod

MISS_BOUND_S = 3.0  # a killed pod's outstanding read must become a miss well within the client timeout


def test_pod_killed_mid_read_turns_the_read_into_a_miss(tmp_path):
    pod = start_pod(tmp_path, "--rate-gbps", "0.02")  # 2.5 MB/s: an 8 MB read takes ~3 s
    client = pod.client(timeout_s=MISS_BOUND_S)
    name, obj = big_chunk(8)
    client.put(name, obj)
    result: list[bool] = []
    reader = threading.Thread(target=lambda: result.append(client.read_into(name, memoryview(bytearray(len(obj))))))
    reader.start()
    time.sleep(0.5)  # the read is under way
    killed = time.monotonic()
    pod.kill()
    reader.join(MISS_BOUND_S + 2)
    assert not reader.is_alive(), "the read did not return after the pod died"
    assert result == [False]
    assert time.monotonic() - killed < MISS_BOUND_S
    assert client.failed_within(10)  # placement will route around it


def test_restarted_pod_serves_everything_it_acknowledged(tmp_path):
    pod = start_pod(tmp_path, "--capacity", "10MiB")
    client = pod.client()
    chunks = make_chunks(12, seed=11)
    for name, obj in chunks:
        client.put(name, obj)  # acknowledged: durable from here on
    pod.kill()  # no clean shutdown
    pod.start()  # same directory, same ports: the index is rebuilt from disk
    try:
        for name, obj in chunks:
            assert client.read(name) == obj  # the pooled connection is stale: retried on a new one
        stats = httpx.get(pod.url("/v1/stats"), headers=pod.headers()).json()
        assert stats["objects"] == 12 and stats["used_bytes"] == sum(len(o) for _, o in chunks)
    finally:
        pod.stop()


def test_capacity_evicts_least_recently_used(tmp_path):
    chunks = make_chunks(6, seed=12)
    size = max(len(obj) for _, obj in chunks)  # sizes differ by a few bytes (header lengths)
    pod = start_pod(tmp_path, "--capacity", str(4 * size))
    client = pod.client()
    try:
        for name, obj in chunks[:4]:
            client.put(name, obj)
        assert client.read(chunks[0][0]) is not None  # chunk 0 is now the most recently used
        for name, obj in chunks[4:]:
            client.put(name, obj)  # evicts chunks 1 and 2, the least recently used
        present = [client.exists(name) for name, _ in chunks]
        assert present == [True, False, False, True, True, True]
        stats = httpx.get(pod.url("/v1/stats"), headers=pod.headers()).json()
        assert stats["evictions"] == 2 and stats["used_bytes"] <= 4 * size
    finally:
        pod.stop()


def test_redis_backend_survives_a_redis_restart(tmp_path):
    redis = redis_server(tmp_path)
    pod = start_pod(tmp_path, "--redis-url", redis.url, backend="redis")
    client = pod.client()
    try:
        chunks = make_chunks(3, seed=13)
        client.put(*chunks[0])
        assert client.read(chunks[0][0]) == chunks[0][1]
        redis.stop()
        assert client.read(chunks[0][0]) is None  # Redis down: a miss, not a crash
        with pytest.raises(StoreError):
            client.put(*chunks[1])
        assert httpx.get(pod.url("/healthz")).status_code == 200
        assert httpx.get(pod.url("/readyz")).status_code == 503
        redis.start()  # same port and directory: its append-only file brings chunk 0 back
        assert client.read(chunks[0][0]) == chunks[0][1]
        client.put(*chunks[2])
        assert client.read(chunks[2][0]) == chunks[2][1]
        assert httpx.get(pod.url("/readyz")).status_code == 200
        assert pod.proc is not None and pod.proc.poll() is None
    finally:
        pod.stop()
        redis.stop()
