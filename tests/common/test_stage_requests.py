"""A stage's requests, as the engine holds them: its KV pool (block accounting, refusal when full, a tenant's
share), one record per request in one table (admission and release one call each), and a restore found
through its request's record: on the admitted record for a worker's request, on a record of its own (gone
with the restore) for a caller that hands the engine its KV."""

from __future__ import annotations

import threading

import pytest
import torch

from cacheflow_common.engine import (
    ConflictError,
    Engine,
    EngineSettings,
    KVPool,
    PoolFullError,
    RequestTable,
    RestoreCancelledError,
    StageRequest,
)
from cacheflow_common.errors import CacheFlowError
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.save import make_job
from cacheflow_common.restore.stage_input import EmbeddingInput
from cacheflow_common.store.memory import MemoryStore
from tests.factories import TINY_COSTS, tiny_model

CHUNK = 16


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model(num_layers=3)


# -- the pool and the table ----------------------------------------------------------------------------
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
    return RequestTable(threading.Condition(), stage=1, pool=pool, stop_restore=stopped.append,
                        on_stream_closed=lambda grant: None)


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


# -- restores through their records ----------------------------------------------------------------------
def _engine(model: Transformer, pool: KVPool | None, policy: str = "compute-only") -> Engine:
    settings = EngineSettings(layers=range(model.config.num_layers), policy=policy, chunk_size=CHUNK,
                              prefill_tokens=CHUNK, step_tokens=CHUNK, costs=TINY_COSTS)
    return Engine.for_stage(settings, model, pool=pool)


class GatedInput(EmbeddingInput):
    """Stage 0's input, ready only once the test opens it: the restore waits, its record there to read."""

    def __init__(self, model: Transformer, job: RestoreJob) -> None:
        super().__init__(model, job.token_ids)
        self.gate = threading.Event()

    def ready(self, start: int, end: int) -> bool:
        return self.gate.is_set()


def _job(model: Transformer, n_tokens: int) -> RestoreJob:
    ids = torch.randint(0, model.config.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(0))
    return make_job(model, ids.tolist(), tenant="t", chunk_size=CHUNK)


def test_an_admitted_requests_restore_runs_on_its_record_which_stays_for_its_forwards(model):
    pool = KVPool(model, range(model.config.num_layers), capacity_tokens=256, block_tokens=CHUNK)
    job = _job(model, 8 * CHUNK)
    with _engine(model, pool) as engine:
        request = engine.requests.admit(StageRequest("r", tenant="t"), 8 * CHUNK)
        assert request.kv is not None
        inputs = GatedInput(model, job)
        restore = engine.submit("r", job, MemoryStore(), request.kv, inputs=inputs)
        try:
            assert engine.requests.get("r") is request and request.restore is restore
            with pytest.raises(ConflictError, match="'r' is already restoring"):
                engine.submit("r", job, MemoryStore(), request.kv)
        finally:
            inputs.gate.set()
        assert restore.done.result(timeout=30).computed == 8  # the second submit did not disturb the first
        assert engine.requests.get("r") is request and request.restore is None  # the record stays, KV and all
        assert engine.requests.release("r") is request and pool.used_blocks == 0


def test_releasing_a_request_while_it_restores_stops_the_restore_and_frees_its_record(model):
    pool = KVPool(model, range(model.config.num_layers), capacity_tokens=256, block_tokens=CHUNK)
    with _engine(model, pool) as engine:
        request = engine.requests.admit(StageRequest("r", tenant="t"), 8 * CHUNK)
        assert request.kv is not None
        job = _job(model, 8 * CHUNK)
        restore = engine.submit("r", job, MemoryStore(), request.kv, inputs=GatedInput(model, job))
        engine.requests.release("r")
        with pytest.raises(RestoreCancelledError, match="'r' was released"):
            restore.done.result(timeout=30)
        assert engine.requests.get("r") is None and pool.used_blocks == 0 and engine.requests.restores() == []


def test_a_restore_of_kv_the_caller_holds_has_a_record_only_while_it_runs(model):
    store, job = MemoryStore(), _job(model, 4 * CHUNK)
    with _engine(model, None) as engine:
        kv = model.new_kv(job.layers, 4 * CHUNK)
        inputs = GatedInput(model, job)
        restore = engine.submit("c", job, store, kv, inputs=inputs)
        seen = engine.requests.get("c")
        inputs.gate.set()
        summary = restore.done.result(timeout=30)
        assert seen is not None and seen.transient and seen.kv is kv
        assert summary.computed == 4
        assert engine.requests.get("c") is None  # gone with its restore
        with pytest.raises(CacheFlowError, match="no KV pool"):
            engine.requests.admit(StageRequest("d"), 16)  # this engine's callers hand it their KV
