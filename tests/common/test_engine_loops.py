"""The engine's compute loop (`StepLoop`) and its channel loaders (`ChannelLoader`), driven directly: a step
runs forward work and the scheduler's restore units in one batched forward within its token budget, a
unit whose input fails fails its request alone; a channel loads what the scheduler gives it, and a read
that fails is a miss that compute restores."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import pytest
import torch

from cacheflow_common.engine.builder import RestoreBuilder
from cacheflow_common.engine.channels import ChannelLoader
from cacheflow_common.engine.core import EngineCore
from cacheflow_common.engine.settings import EngineSettings
from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.engine.step_loop import StepLoop
from cacheflow_common.engine.step_plan import ForwardItem, StepBudget, StepPlan
from cacheflow_common.kv.keys import object_name
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.restore.boundary import BoundaryMissingError
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.pointers import Unit
from cacheflow_common.restore.save import compute_prefix_kv, make_job, save_prefix
from cacheflow_common.restore.stage_input import StageInput
from cacheflow_common.restore.upstream import UpstreamInput
from cacheflow_common.sched.policies import make_policy
from cacheflow_common.sched.scheduler import BatchScheduler
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.store.memory import MemoryStore
from tests.factories import TINY_COSTS, tiny_model

CHUNK = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model(num_layers=3)


class Stage:
    """One stage's engine parts, assembled by hand: the shared core, the builder and the compute loop."""

    def __init__(self, model: Transformer, policy: str, *, step_tokens: int = 64, beside_forward_tokens: int = 0
                 ) -> None:
        self.model = model
        self.settings = EngineSettings(layers=range(model.config.num_layers), policy=policy, chunk_size=CHUNK,
                                       prefill_tokens=CHUNK, step_tokens=step_tokens,
                                       beside_forward_tokens=beside_forward_tokens, costs=TINY_COSTS)
        self.core = EngineCore(BatchScheduler(make_policy(policy), n_stages=1), stage=0, n_channels=1)
        self.builder = RestoreBuilder(self.settings, model, on_input=self.core.wake_loop)
        self.plans: list[StepPlan] = []
        budget = StepBudget(step_tokens=step_tokens, beside_forward_tokens=beside_forward_tokens)
        self.loop = StepLoop(self.core, model, self.settings.layers, budget=budget, sampler=_no_sampling,
                             on_step=lambda plan, seconds: self.plans.append(plan))

    def admit(self, request_id: str, job: RestoreJob, store: ChunkStore, inputs: StageInput | None = None
              ) -> StageRestore:
        kv = self.model.new_kv(job.layers, len(job.token_ids))
        restore = self.builder.build(request_id, job, store, kv, self.settings.policy, input_mode="boundary",
                                     arrival_s=time.perf_counter(), inputs=inputs)
        self.core.admit_restore(restore)
        return restore

    def channel(self, on_load: Callable[[int, float], None] = lambda channel, seconds: None) -> ChannelLoader:
        return ChannelLoader(self.core, 0, on_load=on_load).start()

    def stop(self, *channels: ChannelLoader) -> None:
        """As the engine stops: every thread waiting on the core wakes to find it stopped."""
        self.core.shut_down()
        for channel in channels:
            channel.join(10)


def _no_sampling(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    raise AssertionError("no test here samples")


def _job(model: Transformer, n_tokens: int, seed: int = 0) -> RestoreJob:
    ids = torch.randint(0, model.config.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(seed))
    return make_job(model, ids.tolist(), tenant="t", chunk_size=CHUNK)


def _assert_kv_equal(got: KVBuffer, want: KVBuffer, n_tokens: int) -> None:
    torch.testing.assert_close(got.data[..., :n_tokens, :], want.data[..., :n_tokens, :], atol=ATOL, rtol=ATOL)


def _step_until(stage: Stage, condition: Callable[[], bool], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the engine stopped making progress"
        stage.loop.step(wait=True)


# -- the compute loop ----------------------------------------------------------------------------------
def test_a_step_runs_forward_work_in_slices_of_its_token_budget(model):
    stage = Stage(model, "compute-only", step_tokens=16)
    rows = model.embed(torch.arange(40))  # [40, hidden]
    item = ForwardItem("f", kv=model.new_kv(stage.settings.layers, 40), start=0, rows=rows, sample=None)
    stage.core.queue_forward(item)
    while stage.loop.step(wait=False):
        pass
    assert [plan.tokens for plan in stage.plans] == [16, 16, 8]
    one_pass = model.forward_layers(rows, stage.settings.layers, [Span(model.new_kv(stage.settings.layers, 40), 0, 40)])
    torch.testing.assert_close(item.future.result(), one_pass, atol=ATOL, rtol=ATOL)  # [40, hidden]


def test_a_step_computes_the_schedulers_units_within_its_budget_until_the_restores_are_done(model):
    stage = Stage(model, "compute-only", step_tokens=2 * CHUNK)  # room for 2 of the 3 requests' units a step
    jobs = {f"r{i}": _job(model, 2 * CHUNK, seed=i) for i in range(3)}
    restores = {rid: stage.admit(rid, job, MemoryStore()) for rid, job in jobs.items()}
    while stage.loop.step(wait=False):
        pass
    # The two oldest take the budget; a request computes one unit a step, so the last goes on alone.
    stepped = [sorted(t.request_id for t in plan.token_units) for plan in stage.plans]
    assert stepped == [["r0", "r1"], ["r0", "r1"], ["r2"], ["r2"]]
    for rid, restore in restores.items():
        assert restore.done.result().computed == 2
        _assert_kv_equal(restore.kv, compute_prefix_kv(model, jobs[rid]), 2 * CHUNK)


def test_forward_work_leaves_restores_only_the_tokens_beside_it(model):
    stage = Stage(model, "compute-only", step_tokens=4 * CHUNK, beside_forward_tokens=0)
    for i in range(2):
        stage.admit(f"r{i}", _job(model, 2 * CHUNK, seed=i), MemoryStore())
    item = ForwardItem("f", kv=model.new_kv(stage.settings.layers, 8), start=0, rows=model.embed(torch.arange(8)),
                       sample=None)
    stage.core.queue_forward(item)
    assert stage.loop.step(wait=False)
    first = stage.plans[0]
    assert first.tokens == 8 and len(first.token_units) == 1  # one unit always fits beside the forward
    assert stage.loop.step(wait=False)
    assert len(stage.plans[1].token_units) == 2  # the forward is done: the budget is the restores' again


class _BrokenInput:
    """A stage input whose rows cannot be read (a corrupt boundary activation, say)."""

    def __call__(self, start: int, end: int) -> torch.Tensor:
        raise OSError("boundary activation unreadable")

    def ready(self, start: int, end: int) -> bool:
        return True


def test_a_unit_whose_input_fails_fails_its_request_alone(model):
    stage = Stage(model, "compute-only")
    good_job = _job(model, 2 * CHUNK, seed=1)
    broken = stage.admit("broken", _job(model, 2 * CHUNK, seed=2), MemoryStore(), inputs=_BrokenInput())
    good = stage.admit("good", good_job, MemoryStore())
    while stage.loop.step(wait=False):
        pass
    assert isinstance(broken.done.exception(), OSError)
    assert good.done.result().computed == 2
    _assert_kv_equal(good.kv, compute_prefix_kv(model, good_job), 2 * CHUNK)


def test_a_fed_chunk_whose_load_missed_waits_for_the_previous_stage_and_fails_once_it_finished_without_it(model):
    """Fed by the previous stage, a chunk whose load missed is computed from its delivery; once that stage
    has finished without sending it, the restore fails with the reason instead of waiting for it."""
    stage = Stage(model, "cacheflow")
    job = _job(model, 2 * CHUNK, seed=3)
    upstream = UpstreamInput(job, timeout_s=60.0)
    channel = stage.channel()
    try:
        restore = stage.admit("fed", job, MemoryStore(), inputs=upstream)  # nothing stored: both loads miss
        upstream.deliver(0, model.embed(torch.tensor(job.token_ids[:CHUNK])))  # [CHUNK, hidden]
        _step_until(stage, lambda: list(restore.states) == [Unit.COMPUTED, Unit.MISSED])
        assert not restore.done.done()
        upstream.finish()
        _step_until(stage, restore.done.done)
    finally:
        stage.stop(channel)
    assert isinstance(restore.done.exception(), BoundaryMissingError)
    assert "did not compute it" in str(restore.done.exception())


# -- the channel loaders -------------------------------------------------------------------------------
def test_a_channel_loads_every_unit_the_scheduler_gives_it(model):
    stage = Stage(model, "load-only")
    store, job = MemoryStore(), _job(model, 3 * CHUNK)
    saved = save_prefix(model, job, store)
    loads: list[int] = []
    before = set(threading.enumerate())
    channel = stage.channel(lambda c, seconds: loads.append(c))
    try:
        restore = stage.admit("a", job, store)
        summary = restore.done.result(timeout=30)
    finally:
        stage.stop(channel)
    assert (summary.loaded, summary.computed, loads) == (3, 0, [0, 0, 0])
    assert torch.equal(restore.kv.data[..., : 3 * CHUNK, :], saved.data[..., : 3 * CHUNK, :])
    assert not set(threading.enumerate()) - before  # the channel's thread ended with its engine


def test_a_channel_waiting_for_work_keeps_nothing_of_the_request_it_loaded(model):
    """Its last request's restore (and with it the KV buffer) goes when the request does, not when the channel
    loads again: a waiting thread that still held it kept one request's KV alive per channel."""
    stage = Stage(model, "load-only")
    store, job = MemoryStore(), _job(model, 2 * CHUNK)
    save_prefix(model, job, store)
    channel = stage.channel()
    try:
        restore = stage.admit("a", job, store)
        assert restore.done.result(timeout=30).loaded == 2
        gone = weakref.ref(restore.kv)
        del restore
        gc.collect()
        assert gone() is None
    finally:
        stage.stop(channel)


class _FailingReads(MemoryStore):
    """A store whose reads of one object fail."""

    def __init__(self, failing: str) -> None:
        super().__init__()
        self.failing = failing

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        if name == self.failing:
            raise ConnectionResetError("pod went away")
        return super().readv_into(name, views, offset)


def test_a_read_that_fails_is_a_miss_and_compute_restores_the_unit(model):
    stage = Stage(model, "load-only")
    job = _job(model, 3 * CHUNK)
    store = _FailingReads(object_name(job.keys[1], "kv", job.layers.start, job.layers.stop))
    saved = save_prefix(model, job, store)
    channel = stage.channel()
    try:
        restore = stage.admit("a", job, store)
        stage.loop.run(until=restore.done.done)  # the loop computes what the channel missed
        summary = restore.done.result()
    finally:
        stage.stop(channel)
    assert (summary.loaded, summary.computed) == (2, 1)
    assert summary.misses == {"loader-error: ConnectionResetError": 1}
    assert restore.records()[1].source == "computed" and restore.records()[1].miss_reason
    _assert_kv_equal(restore.kv, saved, 3 * CHUNK)
