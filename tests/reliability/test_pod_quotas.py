"""Tenants sharing a storage pod: each is guaranteed its share of the capacity, borrows only what the
others leave unused, and sees only its own counts (real pod processes for the pod; the store's
eviction order in process)."""

from __future__ import annotations

import re

import httpx
import pytest

from cacheflow_common.errors import ConfigError, StoreError
from cacheflow_common.store.lru import LruStore
from cacheflow_common.store.memory import MemoryStore
from cacheflow_services.storage.config import StorageConfig, parse_tenant_shares
from tests.services.chunks import make_chunks
from tests.services.procs import Pod, start_pod


def stats(pod: Pod, tenant: str) -> dict[str, float]:
    r = httpx.get(pod.url("/v1/stats"), headers=pod.headers(tenant))
    assert r.status_code == 200
    return dict(r.json())


def metric(pod: Pod, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", httpx.get(pod.url("/metrics")).text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


def test_a_tenant_within_its_share_keeps_its_chunks_and_sees_only_its_counts(tmp_path):
    alpha_chunks = make_chunks(12, seed=1, tenant="alpha")
    beta_chunks = make_chunks(3, seed=2, tenant="beta")
    size = max(len(obj) for _, obj in alpha_chunks + beta_chunks)
    pod = start_pod(tmp_path, "--capacity", str(8 * size))  # alpha and beta: 4 chunks' worth each
    try:
        alpha, beta = pod.client("alpha"), pod.client("beta")
        for name, obj in beta_chunks:
            beta.put(name, obj)
        for name, obj in alpha_chunks:  # alpha floods the pod
            alpha.put(name, obj)
        assert [beta.exists(n) for n, _ in beta_chunks] == [True] * 3  # before: alpha's writes evicted them
        assert [alpha.exists(n) for n, _ in alpha_chunks] == [False] * 7 + [True] * 5  # what beta leaves
        assert beta.read(beta_chunks[0][0]) == beta_chunks[0][1]
        a, b = stats(pod, "alpha"), stats(pod, "beta")
        assert (a["objects"], a["evictions"], a["writes"], a["hits"]) == (5, 7, 12, 0)
        assert (b["objects"], b["evictions"], b["writes"], b["hits"]) == (3, 0, 3, 1)
        assert a["share_bytes"] == b["share_bytes"] == 4 * size
        assert b["used_bytes"] == sum(len(obj) for _, obj in beta_chunks)
        assert metric(pod, "cacheflow_storage_objects") == 8  # pod-wide numbers stay on /metrics
        assert metric(pod, "cacheflow_storage_evictions") == 7
    finally:
        pod.stop()


def test_room_a_tenant_borrowed_goes_back_to_its_owner(tmp_path):
    alpha_chunks = make_chunks(8, seed=3, tenant="alpha")
    beta_chunks = make_chunks(6, seed=4, tenant="beta")
    size = max(len(obj) for _, obj in alpha_chunks + beta_chunks)
    pod = start_pod(tmp_path, "--capacity", str(8 * size))
    try:
        alpha, beta = pod.client("alpha"), pod.client("beta")
        for name, obj in alpha_chunks:  # alpha alone fills the pod: it borrows beta's idle share
            alpha.put(name, obj)
        assert stats(pod, "alpha")["objects"] == 8 and stats(pod, "alpha")["evictions"] == 0
        assert alpha.read(alpha_chunks[0][0]) == alpha_chunks[0][1]  # the pod now knows its layout
        for name, obj in beta_chunks[:4]:  # beta takes its share back: alpha's oldest go
            beta.put(name, obj)
        assert [alpha.exists(n) for n, _ in alpha_chunks] == [True] + [False] * 4 + [True] * 3
        for name, obj in beta_chunks[4:]:  # beta goes over its share: its own oldest go, not alpha's
            beta.put(name, obj)
        assert [alpha.exists(n) for n, _ in alpha_chunks] == [True] + [False] * 4 + [True] * 3  # before: 2 more
        assert [beta.exists(n) for n, _ in beta_chunks] == [False] * 2 + [True] * 4  # over its share: its own go
    finally:
        pod.stop()


def test_explicit_shares_and_the_even_split_of_the_rest():
    tokens = {"a-long-enough-secret-token-1": "alpha", "a-long-enough-secret-token-2": "beta",
              "a-long-enough-secret-token-3": "gamma", "a-long-enough-secret-token-4": "alpha"}
    config = StorageConfig(backend="memory", tokens=tokens, capacity_bytes=1000,
                           tenant_shares=parse_tenant_shares(["beta=600"]))
    assert config.share_of_every_tenant() == {"alpha": 200, "beta": 600, "gamma": 200}
    with pytest.raises(ConfigError, match="exceed the capacity"):
        StorageConfig(backend="memory", tokens=tokens, capacity_bytes=1000, tenant_shares={"beta": 1001})
    with pytest.raises(ConfigError, match="without a token"):
        StorageConfig(backend="memory", tokens=tokens, capacity_bytes=1000, tenant_shares={"delta": 1})
    with pytest.raises(ConfigError, match="TENANT=SIZE"):
        parse_tenant_shares(["beta"])


def test_a_write_that_only_fits_by_taking_from_an_owner_within_its_share_fails():
    store = LruStore(MemoryStore(), 300, owner_of=lambda name: name[0], shares={"a": 100, "b": 200})
    store.put("b1", b"x" * 200)  # b: exactly its share
    store.put("a1", b"x" * 100)
    with pytest.raises(StoreError, match="over its share"):
        store.put("a2", b"x" * 150)  # a is then over its share, and b within its own
    assert store.exists("b1") and store.exists("a1") and not store.exists("a2")
    assert store.usage("a") == (1, 100, 0) and store.usage("b") == (1, 200, 0)
