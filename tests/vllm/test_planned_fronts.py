"""Planned restores' fronts recomputed over vLLM's steps (`planned_fronts.py`, `planned_loads.py`): each step takes at
most the token budget, in order; a front spread over steps leaves the same KV in the blocks as one recomputed in one
go; in the background, one step of fronts runs per vLLM step (fronts a step starts run their first step there, the
older ones wait), every step left in a step with nothing else to run, a restore is reported only once its front is
done, the slices of a request vLLM finished are left out, and its timeout never cuts a front short. The forwards run
CacheFlow's tiny model through the interface vLLM's model lends the connector (`embed`, `forward_layers` over spans
of a restore's KV), into a KV buffer of the restore's own rather than vLLM's blocks (CacheFlow's attention reads no
blocks; vLLM's kernels are in vLLM's process): vLLM's own forwards over steps run on two tensor-parallel vLLM ranks
in `test_step_aside.py`."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.restore.save import make_job, save_prefix
from cacheflow_common.store.memory import MemoryStore
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.both_sides import blocks_from
from cacheflow_services.vllm_connector.draft import Restored
from cacheflow_services.vllm_connector.plan import LoadSpec
from cacheflow_services.vllm_connector.planned_fronts import front_forwards, front_steps, step_token_budget
from cacheflow_services.vllm_connector.planned_loads import PlannedLoads
from cacheflow_services.vllm_connector.planned_split import RunningSplit, Split, SplitPlan, start_splits
from cacheflow_services.vllm_connector.vllm_runtime import VllmRuntime
from tests.factories import tiny_model

CHUNK, BS = 16, 8
N = 6 * CHUNK
BLOCKS = tuple(range(1, N // BS + 1))  # the request's, as vLLM names them (for the blocks it must recompute)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("seed", range(20))
def test_steps_keep_the_forwards_in_order_within_the_budget(seed):
    rng = torch.Generator().manual_seed(seed)
    budget = int(torch.randint(16, 400, (1,), generator=rng))
    forward_tokens = int(torch.randint(8, 600, (1,), generator=rng))
    starts = torch.randint(0, 300, (int(torch.randint(1, 5, (1,), generator=rng)),), generator=rng).tolist()
    forwards = front_forwards([(a, a + int(torch.randint(0, 900, (1,), generator=rng))) for a in starts],
                              forward_tokens)
    steps = front_steps(forwards, budget)
    assert [forward for step in steps for forward in step] == forwards
    for step in steps:
        tokens = sum(b - a for forward in step for _, a, b in forward)
        assert tokens <= budget or len(step) == 1  # a forward larger than the budget takes a step alone
    for step, after in itertools.pairwise(steps):  # no step left room the next one's first forward fit
        first = sum(b - a for _, a, b in after[0])
        assert sum(b - a for forward in step for _, a, b in forward) + first > budget
    assert front_steps(forwards, None) == ([forwards] if forwards else [])


def test_the_step_budget_is_vllms_own_for_one_requests_prefill():
    def config(threshold: int) -> SimpleNamespace:
        return SimpleNamespace(scheduler_config=SimpleNamespace(long_prefill_token_threshold=threshold,
                                                                max_num_batched_tokens=4096))

    assert step_token_budget(config(0)) == 4096
    assert step_token_budget(config(512)) == 512
    assert step_token_budget(None) is None


def _job(model):
    return make_job(model, [i % model.config.vocab_size for i in range(N)], tenant="t", chunk_size=CHUNK)


def _buffer(model, start: int, reference: torch.Tensor) -> KVBuffer:
    """A restore's KV, holding vLLM's own prefix [0, start) as its blocks would (`reference`: a full prefill's)."""
    kv = model.new_kv(range(model.config.num_layers), N)
    kv.data[:, :, :, :start] = reference[:, :, :, :start]  # [L, 2, Hkv, start, D]
    return kv


def _plan(job, kv: KVBuffer, start: int, front: int) -> SplitPlan:
    return SplitPlan(job, cast(BlockKV, kv), start, front)  # what a BlockKV lends a split, from a buffer of its own


def _side(model) -> VllmRuntime:
    return cast(VllmRuntime, model)  # embed and forward_layers over spans, as vLLM's model lends them


def test_a_front_spread_over_steps_leaves_the_kv_of_one_recomputed_in_one_go(model):
    """Two restores started together, their fronts (3 and 4 chunks) in steps of one chunk: the first step runs at
    the start, one per `step` after; the blocks then hold what a full prefill computes, as after one go."""
    job, store = _job(model), MemoryStore()
    reference = save_prefix(model, job, store).data  # [L, 2, Hkv, N, D]
    timed: list[float] = []
    kv_a, kv_b = _buffer(model, 0, reference), _buffer(model, CHUNK, reference)
    plans = [_plan(job, kv_a, 0, 3 * CHUNK), _plan(job, kv_b, CHUNK, 5 * CHUNK)]
    running = start_splits(plans, store, _side(model), prefill_tokens=2048, step_tokens=CHUNK,
                           on_fronts_done=timed.append)
    fronts = running[0].fronts
    assert fronts is not None and running[1].fronts is fronts
    steps = 1
    while fronts.pending:
        assert not any(split.ended for split in running) and not timed
        fronts.step()
        steps += 1
    assert steps == 7 and len(timed) == 1 and timed[0] == pytest.approx(fronts.elapsed_s)  # 3 + 4 chunks
    for split in running:
        split.join()
        assert split.ended
    done = [split.result() for split in running]
    assert [(d.end, d.computed, d.loaded, d.miss, d.front_steps) for d in done] == [(N, 3, 3, "", 3), (N, 4, 1, "", 4)]
    for kv in (kv_a, kv_b):
        torch.testing.assert_close(kv.data, reference, rtol=1e-4, atol=1e-5)

    kv = _buffer(model, 0, reference)
    [once] = start_splits([_plan(job, kv, 0, 3 * CHUNK)], store, _side(model), prefill_tokens=2048)
    assert once.fronts is not None and not once.fronts.pending  # no budget: all in the step that starts it
    once.join()
    torch.testing.assert_close(kv.data, kv_a.data, rtol=1e-5, atol=1e-6)  # the same sums, sliced otherwise


class Restorer:
    """The worker engine's part, with vLLM's model: every restore recomputes its first 3 chunks, one chunk per
    step, and loads the rest."""

    def __init__(self, model, store: MemoryStore) -> None:
        self.model, self.store = model, store
        self.kv: dict[str, KVBuffer] = {}
        self.reference = save_prefix(model, _job(model), store).data  # [L, 2, Hkv, N, D]
        self.ended: dict[str, Split] = {}
        self.drafts = False

    def start_splits(self, specs: Sequence[LoadSpec], *, on_loaded: Callable[[], None], in_steps: bool
                     ) -> list[RunningSplit | BaseException]:
        plans = []
        for spec in specs:
            kv = self.kv[spec.req_id] = _buffer(self.model, spec.start, self.reference)
            plans.append(_plan(_job(self.model), kv, spec.start, 3 * CHUNK))
        return list(start_splits(plans, self.store, _side(self.model), prefill_tokens=2048,
                                 step_tokens=CHUNK if in_steps else None, on_loaded=on_loaded))

    def split_done(self, spec: LoadSpec, done: Split, *, elapsed_s: float, asynchronous: bool) -> set[int]:
        self.ended[spec.req_id] = done
        return blocks_from(spec, done.end, BS) if done.miss else set()

    def failed_load(self, spec: LoadSpec, exc: BaseException) -> set[int]:
        return blocks_from(spec, spec.start, BS)

    def agree_min(self, values: list[int]) -> list[int]:
        return values

    def rerun_drafts(self, restored: Sequence[Restored]) -> set[int]:
        return set()


def _rig(model, *, timeout_s: float = 60.0) -> tuple[Restorer, PlannedLoads, torch.Tensor]:
    restorer = Restorer(model, MemoryStore())
    return restorer, PlannedLoads(restorer, timeout_s=timeout_s), restorer.reference


def _spec(model, request_id: str) -> LoadSpec:
    return LoadSpec(request_id, _job(model).token_ids, BLOCKS, 0)


def _steps_until(loads: PlannedLoads, request_id: str) -> int:
    """vLLM steps (collects) until `request_id` is reported."""
    for step in range(1, 200):
        for thread in threading.enumerate():  # its loads end before the next collect: only the fronts count
            if thread.name == "cacheflow-planned-loads":
                thread.join(10)
        done, failed = loads.collect([], idle=False)
        assert not failed
        if request_id in done:
            return step
    raise AssertionError(f"{request_id} was never reported")


def test_one_step_of_fronts_runs_per_vllm_step_and_a_restore_is_reported_once_its_front_is_done(model):
    restorer, loads, reference = _rig(model)
    loads.start([_spec(model, "a")])  # its first chunk now; none more in this vLLM step; one per step after
    assert _steps_until(loads, "a") == 3
    torch.testing.assert_close(restorer.kv["a"].data, reference, rtol=1e-4, atol=1e-5)
    assert restorer.ended["a"].computed == 3 and restorer.ended["a"].loaded == 3

    loads.start([_spec(model, "b")])
    assert loads.collect([], idle=False) == (set(), set())
    assert loads.collect([], idle=False) == (set(), set())  # b's second chunk
    loads.start([_spec(model, "c")])  # c's first: b waits this step
    assert loads.collect([], idle=False) == (set(), set())
    assert not restorer.kv["b"].data[:, :, :, 2 * CHUNK : 3 * CHUNK].any()
    assert _steps_until(loads, "b") == 1  # b's third
    assert _steps_until(loads, "c") == 2  # then c's second and third
    for request_id in "bc":
        torch.testing.assert_close(restorer.kv[request_id].data, reference, rtol=1e-4, atol=1e-5)


def test_a_step_with_nothing_else_to_run_runs_every_step_left(model):
    restorer, loads, reference = _rig(model)
    loads.start([_spec(model, "a"), _spec(model, "b")])
    loads.start([_spec(model, "c")])
    for thread in threading.enumerate():  # the loads end: only the fronts hold the restores back
        if thread.name == "cacheflow-planned-loads":
            thread.join(10)
    assert loads.collect([], idle=True) == ({"a", "b", "c"}, set())
    # vLLM steps each front ran in: a's first chunk and c's in the steps that started them (b's came after a's)
    assert {request_id: done.front_steps for request_id, done in restorer.ended.items()} == {"a": 2, "b": 1, "c": 2}
    for request_id in "abc":
        torch.testing.assert_close(restorer.kv[request_id].data, reference, rtol=1e-4, atol=1e-5)


def test_a_request_vllm_finishes_mid_front_is_reported_at_once_and_its_front_goes_no_further(model):
    restorer, loads, _ = _rig(model)
    loads.start([_spec(model, "a")])
    assert loads.collect(["a"], idle=False) == ({"a"}, set())
    assert loads.collect([], idle=False) == (set(), set())
    written = restorer.kv["a"].data
    assert written[:, :, :, :CHUNK].any() and not written[:, :, :, CHUNK : 3 * CHUNK].any()  # its first step only


def test_a_timeout_never_cuts_a_front_short(model):
    restorer, loads, reference = _rig(model, timeout_s=0.0)
    loads.start([_spec(model, "a")])
    for _ in range(2):  # none more in the step that started it, then its second chunk: late, but stepping
        assert loads.collect([], idle=False) == (set(), set())
    done, failed = loads.collect([], idle=False)  # its third: the front done, the restore is late now
    assert done == {"a"} and restorer.ended["a"].computed == 3
    assert failed == blocks_from(_spec(model, "a"), restorer.ended["a"].end, BS)
    torch.testing.assert_close(restorer.kv["a"].data[:, :, :, : 3 * CHUNK],
                               reference[:, :, :, : 3 * CHUNK], rtol=1e-4, atol=1e-5)
