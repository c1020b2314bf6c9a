"""One absent chunk must not make a layer-wise restore recompute everything: each layer load reads that
layer from every chunk, so a hole would fail every layer load (after reading the other chunks for
nothing). The worker's engine and the library's `restore` check which chunks exist first and restore a
prefix with holes token-wise, loading the chunks that are there. A truncated chunk is a hole too.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from cacheflow_common.engine import restore
from cacheflow_common.kv.keys import object_name
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.restore.profile import Crossover, Profile
from cacheflow_common.restore.save import compute_prefix_kv, make_job, save_prefix
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_services.worker.config import WorkerConfig
from cacheflow_services.worker.engine import StageEngine
from tests.factories import tiny_model

CHUNK = 16
TENANT = "alpha"
# Recomputing is predicted to be far slower than loading, so the plan loads every chunk it can.
SLOW_COMPUTE = CostModel(chunk_compute=LinearCost(fixed_s=0.5, per_token_s=0.05, per_token_ctx_s=0.0),
                         layer_compute=LinearCost(fixed_s=0.5, per_token_s=0.05, per_token_ctx_s=0.0),
                         load=LoadCost(bytes_per_s=1e9, latency_s=1e-5))


def _damage(store: MemoryStore, name: str, how: str) -> None:
    """Make one chunk object a hole: deleted, or cut short (in its sections, or to a few bytes)."""
    data = store.read(name)
    assert data is not None
    if how == "deleted":
        store.delete(name)
    else:
        store.put(name, data[: len(data) // 2 if how == "truncated" else 10])


DAMAGES = ["deleted", "truncated", "stub"]


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model(seed=5, num_layers=4)


@pytest.fixture
def engine(model: Transformer) -> Iterator[tuple[StageEngine, MemoryStore]]:
    store = MemoryStore()
    profile = Profile(model=model.fingerprint(), model_name="tiny", dtype="float32", chunk_size=CHUNK, threads=1,
                      costs=SLOW_COMPUTE, crossovers=(Crossover(link_bytes_per_s=1e9, l_delta=1 << 20),))
    config = WorkerConfig(stage=0, layers=range(model.config.num_layers), last_stage=True, chunk_size=CHUNK,
                          pods=(PodAddress.parse("pod-0=127.0.0.1:7400"),), pod_tokens={TENANT: "unused"},
                          policy="cacheflow")
    made = StageEngine(config, model, {TENANT: store}, profile, None)
    yield made, store
    made.close()


@pytest.mark.parametrize("how", DAMAGES)
def test_a_layer_wise_restore_with_one_chunk_missing_goes_token_wise_and_loads_the_rest(model, engine, how):
    engine_, store = engine
    rng = random.Random(11)
    ids = [rng.randrange(384) for _ in range(5 * CHUNK + 7)]  # 6 chunks, the last one short
    job = make_job(model, ids, tenant=TENANT, chunk_size=CHUNK)
    save_prefix(model, job, store)
    expected = compute_prefix_kv(model, job).data[:, :, :, : len(ids)]

    whole = engine_.restore("whole", ids, tenant=TENANT, input_mode="boundary", reserve_tokens=0)
    assert whole.mode == "layer" and whole.loaded >= 1 and not whole.misses  # a short prefix: layer-wise

    hole = 2
    _damage(store, object_name(job.keys[hole], "kv", 0, model.config.num_layers), how)
    summary = engine_.restore("holed", ids, tenant=TENANT, input_mode="boundary", reserve_tokens=0)
    torch.testing.assert_close(engine_.kv_of("holed"), expected, atol=1e-4, rtol=1e-4)
    assert summary.mode == "token" and summary.policy == "cacheflow"
    assert "absent from storage" in summary.fallback and f"chunks {hole} of {len(job.keys)}" in summary.fallback
    assert summary.loaded + summary.computed == len(job.keys) and summary.loaded >= len(job.keys) - 2
    assert set(summary.misses) <= {"absent"} and sum(summary.misses.values()) <= 1  # only the hole, if tried
    loaded_bytes = sum(len(store.read(object_name(k, "kv", 0, model.config.num_layers)) or b"")
                       for i, k in enumerate(job.keys) if i != hole)
    assert summary.bytes_loaded <= loaded_bytes  # nothing read for a load that then missed


@pytest.mark.parametrize("how", DAMAGES)
def test_the_library_restore_goes_token_wise_over_a_hole_too(model, how):
    store = MemoryStore()
    rng = random.Random(12)
    ids = [rng.randrange(384) for _ in range(5 * CHUNK + 7)]
    job = make_job(model, ids, tenant=TENANT, chunk_size=CHUNK)
    save_prefix(model, job, store)
    _damage(store, object_name(job.keys[2], "kv", 0, model.config.num_layers), how)
    result = restore(job, model=model, store=store, policy="cacheflow-layer", costs=SLOW_COMPUTE)
    assert result.mode == "token"  # layer-wise would have failed every layer load and recomputed it all
    expected = compute_prefix_kv(model, job).data[:, :, :, : len(ids)]
    torch.testing.assert_close(result.kv.data[:, :, :, : len(ids)], expected, atol=1e-4, rtol=1e-4)
    assert sum(r.source == "loaded" for r in result.units) >= len(job.keys) - 2
