"""The stage worker's KV pool: block accounting, refusal when full, release, and config checks."""

from __future__ import annotations

import pytest

from cacheflow_common.errors import ConfigError
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_services.worker.config import WorkerConfig, parse_layers
from cacheflow_services.worker.pool import KVPool, PoolFullError
from tests.factories import tiny_model


def test_pool_hands_out_whole_blocks_and_refuses_what_does_not_fit():
    pool = KVPool(tiny_model(num_layers=4), range(2, 4), capacity_tokens=64, block_tokens=16)
    kv = pool.allocate("a", 17)  # two blocks
    assert kv.capacity == 32 and kv.layer_start == 2 and pool.used_blocks == 2
    pool.allocate("b", 32)
    with pytest.raises(PoolFullError, match="2 blocks asked, 0 free"):
        pool.allocate("c", 20)
    with pytest.raises(PoolFullError, match="already holds"):
        pool.allocate("a", 1)
    assert pool.release("a") and not pool.release("a")
    assert pool.allocate("c", 20).capacity == 32 and pool.requests() == 2


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
