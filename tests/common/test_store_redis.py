"""The Redis backend against a real redis-server on loopback."""

from __future__ import annotations

import pytest

from cacheflow_common.errors import BadRequestError, StoreError
from cacheflow_common.store.base import open_store
from cacheflow_common.store.redis_store import RedisStore
from tests.services.procs import redis_server


@pytest.fixture()
def redis(tmp_path):
    server = redis_server(tmp_path)
    yield server
    server.stop()


def test_round_trip_and_ranged_reads(redis):
    store = open_store(redis.url)
    assert isinstance(store, RedisStore)
    store.put("abc.kv.L0-2", b"0123456789")
    buf = bytearray(4)
    assert store.read_into("abc.kv.L0-2", memoryview(buf), 3) and bytes(buf) == b"3456"
    assert not store.read_into("abc.kv.L0-2", memoryview(buf), 8)  # past the end: a miss
    parts = [bytearray(2), bytearray(0), bytearray(3)]
    assert store.readv_into("abc.kv.L0-2", [memoryview(p) for p in parts], 4)
    assert b"".join(parts) == b"45678"
    assert store.read("abc.kv.L0-2") == b"0123456789" and store.size("abc.kv.L0-2") == 10
    assert store.size("absent") is None and not store.exists("absent")
    store.put("empty", b"")
    assert store.size("empty") == 0  # present, zero bytes: not the same as absent
    assert sorted(store.entries()) == [("abc.kv.L0-2", 10), ("empty", 0)]
    store.delete("abc.kv.L0-2")
    assert store.read("abc.kv.L0-2") is None


def test_bad_names(redis):
    store = RedisStore(redis.url)
    with pytest.raises(BadRequestError):
        store.put("../x", b"1")
    assert store.read("../x") is None and not store.read_into("../x", memoryview(bytearray(1)))


def test_redis_down_is_a_miss_or_a_store_error(redis):
    store = RedisStore(redis.url, timeout_s=0.5)
    store.put("k1", b"v")
    redis.stop()
    assert store.read("k1") is None and not store.read_into("k1", memoryview(bytearray(1)))
    assert not store.ping()
    with pytest.raises(StoreError):
        store.put("k2", b"v")
    redis.start()
    assert store.read("k1") == b"v" and store.ping()
