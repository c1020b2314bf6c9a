"""The stage worker's config checks (its KV pool and request table are the engine's:
tests/common/test_stage_requests.py)."""

from __future__ import annotations

import pytest

from cacheflow_common.errors import ConfigError
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_services.worker.config import WorkerConfig, parse_layers

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
