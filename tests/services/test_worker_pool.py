"""The stage worker's KV pool (block accounting, refusal when full, a tenant's share), its request table's
admission and release (one call each), and config checks."""

from __future__ import annotations

import pytest

from cacheflow_common.errors import ConfigError
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_services.worker.config import WorkerConfig, parse_layers
from cacheflow_services.worker.pool import KVPool, PoolFullError
from cacheflow_services.worker.requests import ConflictError, RequestTable, StageRequest
from tests.factories import tiny_model


def test_pool_hands_out_whole_blocks_and_refuses_what_does_not_fit():
    pool = KVPool(tiny_model(num_layers=4), range(2, 4), capacity_tokens=64, block_tokens=16)
    a = pool.grant(17)  # two blocks
    assert a.kv.capacity == 32 and a.kv.layer_start == 2 and a.blocks == 2 and pool.used_blocks == 2
    pool.grant(32)
    with pytest.raises(PoolFullError, match="2 blocks asked, 0 free"):
        pool.grant(20)
    pool.give_back(a)
    assert pool.grant(20).kv.capacity == 32 and pool.requests() == 2 and pool.free_blocks == 0


def test_a_tenant_holds_at_most_its_share_of_the_pool():
    pool = KVPool(tiny_model(num_layers=4), range(0, 4), capacity_tokens=64, block_tokens=16, tenant_share=0.5)
    pool.grant(32, tenant="a")
    with pytest.raises(PoolFullError, match="tenant 'a' holds 2 of its 2 blocks"):
        pool.grant(1, tenant="a")
    assert pool.grant(32, tenant="b").blocks == 2


def _table(pool: KVPool, stopped: list[str]) -> RequestTable:
    return RequestTable(pool, stage=1, stop_restore=stopped.append)


def test_admission_is_one_call_and_a_second_one_is_a_conflict_before_the_pool_is_asked():
    pool = KVPool(tiny_model(num_layers=4), range(0, 4), capacity_tokens=32, block_tokens=16)
    table = _table(pool, [])
    request = table.admit(StageRequest("r", tenant="t"), 32)  # the whole pool
    assert request.kv is not None and request.kv.capacity == 32 and pool.requests() == 1
    with pytest.raises(ConflictError, match="'r' already holds KV on stage 1"):
        table.admit(StageRequest("r", tenant="t"), 1)  # a conflict, not "pool full"
    assert pool.used_blocks == 2 and table.get("r") is request


def test_release_is_one_call_that_stops_the_restore_and_gives_the_grant_back():
    pool = KVPool(tiny_model(num_layers=4), range(0, 4), capacity_tokens=64, block_tokens=16)
    stopped: list[str] = []
    table = _table(pool, stopped)
    table.admit(StageRequest("r", tenant="t"), 20)
    released = table.release("r")
    assert released is not None and released.grant is not None
    assert stopped == ["r"] and table.get("r") is None and pool.used_blocks == 0 and pool.requests() == 0
    assert table.release("r") is None and pool.requests() == 0  # a second release frees nothing


POD = (PodAddress("p", "127.0.0.1", 1),)


@pytest.mark.parametrize("overrides,reason", [
    ({"last_stage": False}, "needs --next-stage"),
    ({"next_stage": "http://x"}, "needs --next-stage"),
    ({"policy": "magic"}, "unknown policy"),
    ({"pods": ()}, "needs storage pods"),
    ({"replicas": 2}, "2 replicas over 1"),
    ({"layers": range(3, 3)}, "need stage >= 0"),
])
def test_worker_config_refuses_inconsistent_settings(overrides, reason):
    settings = {"stage": 0, "layers": range(0, 4), "last_stage": True, "pods": POD, "pod_tokens": {"a": "t"}}
    with pytest.raises(ConfigError, match=reason):
        WorkerConfig(**{**settings, **overrides})


def test_parse_layers():
    assert parse_layers("2:6") == range(2, 6)
    for bad in ("6:2", "2", "a:b", "3:3"):
        with pytest.raises(ConfigError):
            parse_layers(bad)
