"""Stages: the layer split, and every stage restoring at once from its stored boundary activations."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from cacheflow_common.engine import RestoreResult, restore
from cacheflow_common.errors import ConfigError
from cacheflow_common.kv.chunk import encode_hidden_chunk
from cacheflow_common.kv.keys import object_name
from cacheflow_common.layer_split import balanced_split, parse_split
from cacheflow_common.restore.boundary import (
    BoundaryInput,
    BoundaryMissingError,
    boundary_name,
    save_prefix_by_stage,
    stage_jobs,
)
from cacheflow_common.restore.save import compute_prefix_kv, make_job
from cacheflow_common.restore.upstream import UpstreamInput
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.shaped import ShapedStore
from cacheflow_common.transport.shaping import TokenBucket
from tests.factories import TINY_COSTS, CountingStore, tiny_model

CHUNK = 16
ATOL = 1e-4


def test_balanced_split_by_count_when_layers_cost_the_same():
    assert balanced_split(8, 2) == [range(0, 4), range(4, 8)]
    assert balanced_split(7, 3) in ([range(0, 3), range(3, 5), range(5, 7)], [range(0, 2), range(2, 5), range(5, 7)],
                                    [range(0, 2), range(2, 4), range(4, 7)])
    assert balanced_split(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]


def test_balanced_split_gives_the_head_stage_fewer_layers_when_the_head_is_costly():
    # 8 layers of 1 s, an LM head worth 2 layers on the last stage: 5 + 3 layers (5 s vs 3 + 2 s).
    assert balanced_split(8, 2, last_extra_s=2.0) == [range(0, 5), range(5, 8)]
    assert balanced_split(8, 2, first_extra_s=2.0) == [range(0, 3), range(3, 8)]


@pytest.mark.parametrize("layers,stages", [(2, 3), (4, 0)])
def test_balanced_split_refuses_impossible_splits(layers, stages):
    with pytest.raises(ConfigError, match="cannot split"):
        balanced_split(layers, stages)


def test_parse_split():
    assert parse_split("0:2,2:4", 4) == [range(0, 2), range(2, 4)]
    for bad in ("0:2,3:4", "0:2,2:3", "0:0,0:4", "zero:4", "0-4"):
        with pytest.raises(ConfigError):
            parse_split(bad, 4)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=3, num_layers=4)


def _saved(model, n_tokens: int, split):
    ids = [random.Random(n_tokens).randrange(model.config.vocab_size) for _ in range(n_tokens)]
    job = make_job(model, ids, tenant="t", chunk_size=CHUNK)
    store = MemoryStore()
    boundary_bytes = save_prefix_by_stage(model, job, split, store)
    return job, store, boundary_bytes


@pytest.mark.parametrize("policy", ["compute-only", "cake", "cacheflow-layer"])
@pytest.mark.parametrize("split", [[range(0, 2), range(2, 4)], [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]])
def test_each_stage_restores_its_layers_from_its_boundary_activations(model, policy, split):
    job, store, boundary_bytes = _saved(model, 3 * CHUNK + 5, split)
    reference = compute_prefix_kv(model, job)  # one process, all layers: [L, 2, Hkv, N, D]
    assert boundary_bytes[0] == 0 and all(b > 0 for b in boundary_bytes[1:])
    for stage in stage_jobs(job, split):
        inputs = BoundaryInput(stage, store) if stage.layers.start else None
        assert inputs is None or inputs.missing() == []
        result = restore(stage, model=model, store=store, policy=policy, stage_input=inputs,
                         costs=None if policy != "cacheflow-layer" else TINY_COSTS)
        got = result.kv.data[:, :, :, : len(job.token_ids)]  # [L_s, 2, Hkv, N, D]
        want = reference.data[stage.layers.start : stage.layers.stop, :, :, : len(job.token_ids)]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        if policy == "compute-only" and inputs is not None:
            assert inputs.bytes_read == boundary_bytes[split.index(stage.layers)]
        if inputs is not None:
            inputs.close()


def test_the_next_chunks_boundary_is_read_while_this_one_computes(model):
    split = [range(0, 2), range(2, 4)]
    job, saved, _ = _saved(model, 3 * CHUNK, split)
    store = CountingStore()
    for name in saved.names():
        store.put(name, saved.read(name) or b"")
    stage = stage_jobs(job, split)[1]
    names = [boundary_name(k, 2) for k in job.keys]
    with BoundaryInput(stage, store, prefetch=1) as inputs:
        first = inputs(0, CHUNK)  # [CHUNK, hidden]
    assert store.reads == names[:2]  # chunk 1 was read ahead, chunk 2 not yet
    assert inputs(CHUNK, 2 * CHUNK).shape == first.shape and store.reads == names[:2]  # served from the read ahead


def test_a_missing_boundary_activation_is_reported_before_and_during_a_restore(model):
    split = [range(0, 2), range(2, 4)]
    job, store, _ = _saved(model, 3 * CHUNK, split)
    stage = stage_jobs(job, split)[1]
    store.delete(boundary_name(job.keys[1], 2))
    inputs = BoundaryInput(stage, store, prefetch=0)
    assert inputs.missing() == [1]
    with pytest.raises(BoundaryMissingError, match="not in the store"):
        restore(stage, model=model, store=MemoryStore(), policy="compute-only", stage_input=inputs)


def test_a_corrupt_or_foreign_boundary_activation_is_never_used(model):
    split = [range(0, 2), range(2, 4)]
    job, store, _ = _saved(model, 2 * CHUNK, split)
    stage = stage_jobs(job, split)[1]
    name = boundary_name(job.keys[0], 2)
    damaged = bytearray(store.read(name) or b"")
    damaged[100] ^= 0xFF  # inside the payload
    store.put(name, bytes(damaged))
    with pytest.raises(BoundaryMissingError, match="corrupt"), BoundaryInput(stage, store) as inputs:
        inputs(0, CHUNK)
    # a valid object for other tokens stored under this chunk's name
    other = make_job(model, [1] * (2 * CHUNK), tenant="t", chunk_size=CHUNK)
    foreign = encode_hidden_chunk(key=other.keys[0], token_ids=other.token_ids[:CHUNK], model=model.fingerprint(),
                                  layer=2, hidden=torch.zeros(CHUNK, model.config.hidden_size), dtype="float32")
    store.put(name, foreign)
    with pytest.raises(BoundaryMissingError, match="other tokens"), BoundaryInput(stage, store) as inputs:
        inputs(0, CHUNK)



def _pipelined(model, job, split, store, first_policy: str):
    """Every stage in its own thread, stage s fed chunk by chunk by stage s-1 (no boundary activations)."""
    stages = stage_jobs(job, split)
    upstreams = [UpstreamInput(stage, timeout_s=30) for stage in stages[1:]]
    results: dict[int, object] = {}

    def run(s: int) -> None:
        deliver = upstreams[s].deliver if s < len(upstreams) else None
        try:
            if s == 0:
                results[s] = restore(stages[0], model=model, store=store, policy=first_policy, on_computed=deliver)
            else:
                results[s] = restore(stages[s], model=model, store=store, policy="cake", stage_input=upstreams[s - 1],
                                     on_computed=deliver)
        except BoundaryMissingError as exc:
            results[s] = exc
            if s < len(upstreams):
                upstreams[s].fail(str(exc))
        else:
            if s < len(upstreams):
                upstreams[s].finish()

    threads = [threading.Thread(target=run, args=(s,)) for s in range(len(stages))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return [results[s] for s in range(len(stages))]


@pytest.mark.parametrize("first_policy", ["compute-only", "cake", "load-only"])
def test_pipelined_fallback_restores_every_stage_from_the_previous_stages_output(model, first_policy):
    split = [range(0, 1), range(1, 3), range(3, 4)]
    job, raw, _ = _saved(model, 8 * CHUNK + 3, split)
    store = ShapedStore(raw, TokenBucket(20e6))  # ~1 ms a chunk: both pointers get work with cake
    reference = compute_prefix_kv(model, job)  # [L, 2, Hkv, N, D]
    results = _pipelined(model, job, split, store, first_policy)
    computed_before = set(range(len(job.keys)))
    for stage, result in zip(stage_jobs(job, split), results, strict=True):
        assert isinstance(result, RestoreResult), result
        got = result.kv.data[:, :, :, : len(job.token_ids)]  # [L_s, 2, Hkv, N, D]
        want = reference.data[stage.layers.start : stage.layers.stop, :, :, : len(job.token_ids)]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        computed = {i for i, src in enumerate(result.sources()) if src == "computed"}
        assert computed == set(range(len(computed)))  # a front run: the two pointers stay contiguous
        assert computed <= computed_before  # a stage computes only chunks the previous one computed
        if stage.layers.start == 0 and first_policy == "compute-only":
            assert computed == set(range(len(job.keys)))
        computed_before = computed


def test_pipelined_stage_fails_clearly_when_it_misses_a_chunk_the_previous_stage_loaded(model):
    split = [range(0, 2), range(2, 4)]
    job, store, _ = _saved(model, 4 * CHUNK, split)
    store.delete(object_name(job.keys[-1], "kv", 2, 4))  # only stage 1's copy of the last chunk
    first, second = _pipelined(model, job, split, store, "load-only")
    assert isinstance(first, RestoreResult) and set(first.sources()) == {"loaded"}
    assert isinstance(second, BoundaryMissingError) and "did not compute it" in str(second)
