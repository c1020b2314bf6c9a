"""Idle means idle: a running cluster with nothing to do takes (almost) no CPU. Every process of a local
cluster (the storage pods with NIXL where it is installed: its endpoint was the one that spun) is measured
from the kernel's accounting (/proc) over 5 s, after a request has set up every connection. An idle
NIXL pod used to hold one thread at 100 % of a core (NIXL's progress thread polls with no timeout)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cacheflow_services.local_cluster import ClusterSpec, LocalCluster, start_cluster
from cacheflow_services.local_process import idle_cpu_share

IDLE_SHARE = 0.02  # of one core
HAS_NIXL = importlib.util.find_spec("nixl") is not None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(model="tiny", stages=2, pods=2, chunk_size=32, dtype="float32", policy="cake", port=0,
                       transport="nixl" if HAS_NIXL else "tcp", threads_per_stage=1)
    local = start_cluster(spec, tmp_path_factory.mktemp("cluster"))
    yield local
    local.stop()


def test_an_idle_cluster_uses_under_two_percent_of_a_core_per_process(cluster: LocalCluster, tmp_path: Path):
    assert all(p.transport == ("nixl" if HAS_NIXL else "tcp") for p in cluster.pods)
    headers = {"Authorization": f"Bearer {cluster.token}"}
    for _ in range(2):  # stored, then restored: every hop and pod connection has been used
        r = httpx.post(f"{cluster.coordinator.url}/v1/completions", headers=headers, timeout=300,
                       json={"model": "tiny", "prompt": list(range(160)), "max_tokens": 2})
        assert r.status_code == 200, r.text
    names, services = zip(*cluster.services(), strict=True)
    shares = idle_cpu_share([s.proc.pid for s in services], 5.0)
    assert dict(zip(names, shares, strict=True)) == pytest.approx(dict.fromkeys(names, 0.0), abs=IDLE_SHARE)
