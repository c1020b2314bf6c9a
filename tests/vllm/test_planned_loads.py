"""Planned restores in the background (`planned_loads.py`): the step that starts one returns while its back
still loads, and each is reported exactly once: when its loads end, when vLLM finished the request meanwhile
(nothing lands in its blocks after), or past its timeout (vLLM recomputes from the last chunk landed); with a
draft, its rerun comes first, once every tensor-parallel rank's loads ended. Real chunks in a store, real
blocks; the worker's part (`start_splits`, `split_done`, the ranks' agreement and the draft's rerun) is a few
lines here, the other rank's flags a list."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch

from cacheflow_common.kv.keys import object_name
from cacheflow_common.restore.save import make_job, save_prefix
from cacheflow_common.store.memory import MemoryStore
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.both_sides import blocks_from
from cacheflow_services.vllm_connector.draft import Restored
from cacheflow_services.vllm_connector.paged import gather
from cacheflow_services.vllm_connector.plan import LoadSpec
from cacheflow_services.vllm_connector.planned_loads import PlannedLoads
from cacheflow_services.vllm_connector.planned_split import RunningSplit, Split, SplitPlan, start_splits
from tests.factories import tiny_model

CHUNK, BS, N = 16, 8, 4 * 16
BLOCKS = tuple(range(1, N // BS + 1))


class GatedStore(MemoryStore):
    """Reads wait until the gate opens."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        assert self.gate.wait(10), "the gate never opened"
        return super().readv_into(name, views, offset)


class Restorer:
    """The worker engine's part: a load-only split into the request's blocks; failed blocks from the end."""

    def __init__(self, model, store: MemoryStore) -> None:
        self.model, self.store = model, store
        c = model.config
        self.caches = {i: torch.zeros(N // BS + 2, c.num_kv_heads, BS, 2 * c.head_dim) for i in range(c.num_layers)}
        self.ended: list[Split] = []
        self.cannot_start: set[str] = set()  # requests whose restore fails to start
        self.drafts = False
        self.other_rank: list[int] | None = None  # the other tensor-parallel rank's ended flags (None: as this one's)
        self.agreements: list[list[int]] = []  # this rank's flags at each agreement
        self.reruns: list[list[Restored]] = []
        self.draft_stops_at: int | None = None  # where each draft's rerun stops (None: where its restore ended)

    def job(self):
        return make_job(self.model, [i % self.model.config.vocab_size for i in range(N)], tenant="t", chunk_size=CHUNK)

    def start_splits(self, specs: Sequence[LoadSpec], *, on_loaded: Callable[[], None], in_steps: bool
                     ) -> list[RunningSplit | BaseException]:
        c = self.model.config
        kvs = [BlockKV(layers=range(c.num_layers), num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, capacity=N,
                       dtype=torch.float32, caches=self.caches, layout="split", block_ids=BLOCKS, block_size=BS,
                       first_writable=spec.start) for spec in specs]
        plans = [SplitPlan(self.job(), kv, spec.start, spec.start) for spec, kv in zip(specs, kvs, strict=True)
                 if spec.req_id not in self.cannot_start]
        running = iter(start_splits(plans, self.store, None, prefill_tokens=2048, on_loaded=on_loaded))
        return [RuntimeError("no plan") if spec.req_id in self.cannot_start else next(running) for spec in specs]

    def split_done(self, spec: LoadSpec, done: Split, *, elapsed_s: float, asynchronous: bool) -> set[int]:
        self.ended.append(done)
        return blocks_from(spec, done.end, BS) if done.miss else set()

    def failed_load(self, spec: LoadSpec, exc: BaseException) -> set[int]:
        return blocks_from(spec, spec.start, BS)

    def agree_min(self, values: list[int]) -> list[int]:
        self.agreements.append(values)
        other = values if self.other_rank is None else self.other_rank
        return [min(mine, theirs) for mine, theirs in zip(values, other, strict=True)]

    def rerun_drafts(self, restored: Sequence[Restored]) -> set[int]:
        self.reruns.append(list(restored))
        stop = self.draft_stops_at
        return set().union(*(blocks_from(r.spec, stop, BS) for r in restored if stop is not None and stop < r.end))

    def in_blocks(self) -> torch.Tensor:
        """[L, 2, Hkv, N, D]: what the request's blocks hold."""
        return torch.stack([gather(self.caches[i], "split", BLOCKS, BS, 0, N) for i in sorted(self.caches)])


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _rig(model, *, timeout_s: float = 60.0) -> tuple[Restorer, GatedStore, PlannedLoads, LoadSpec, torch.Tensor]:
    store = GatedStore()
    restorer = Restorer(model, store)
    job = restorer.job()
    reference = save_prefix(model, job, store).data  # [L, 2, Hkv, N, D]
    spec = LoadSpec("r", job.token_ids, BLOCKS, 0, load_only=True)
    return restorer, store, PlannedLoads(restorer, timeout_s=timeout_s), spec, reference


def test_the_step_returns_while_the_back_loads_and_the_restore_is_reported_once_it_ends(model):
    restorer, store, loads, spec, reference = _rig(model)
    loads.start([spec])  # returns with every read still waiting at the gate
    assert loads.collect([], idle=True) == (set(), set()) and loads.in_flight == 1
    store.gate.set()
    reported: set[str] = set()
    for _ in range(100):
        done, failed = loads.collect([], idle=True)
        assert not failed
        reported |= done
        if reported:
            break
    assert reported == {"r"} and loads.in_flight == 0
    split = restorer.ended[0]
    assert (split.end, split.computed, split.loaded, split.miss) == (N, 0, 4, "")
    assert torch.equal(restorer.in_blocks(), reference)  # exact
    assert loads.collect([], idle=False) == (set(), set())  # once


def test_a_restore_that_cannot_start_is_reported_at_once_and_the_others_of_its_step_go_on(model):
    restorer, store, loads, spec, reference = _rig(model)
    restorer.cannot_start = {"broken"}
    loads.start([LoadSpec("broken", spec.token_ids, BLOCKS, 0, load_only=True), spec])
    assert loads.collect([], idle=False) == ({"broken"}, set(BLOCKS)) and loads.in_flight == 1  # vLLM recomputes it
    store.gate.set()
    reported: set[str] = set()
    for _ in range(100):
        done, _failed = loads.collect([], idle=True)
        reported |= done
        if reported:
            break
    assert reported == {"r"} and torch.equal(restorer.in_blocks(), reference)


def test_a_request_vllm_finishes_while_it_loads_is_reported_at_once_and_nothing_lands_after(model):
    restorer, store, loads, spec, _ = _rig(model)
    loads.start([spec])
    assert loads.collect(["r"], idle=False) == ({"r"}, set())  # vLLM frees its blocks once it reads this
    store.gate.set()  # the read in flight goes on, into sealed blocks
    for thread in threading.enumerate():
        if thread.name == "cacheflow-planned-loads":
            thread.join(10)
    assert not restorer.in_blocks().any() and not restorer.ended


def test_a_restore_past_its_timeout_is_reported_with_the_blocks_from_its_last_landed_chunk(model):
    restorer, store, loads, spec, _ = _rig(model, timeout_s=0.0)
    loads.start([spec])
    done, failed = loads.collect([], idle=False)
    store.gate.set()
    assert done == {"r"} and failed == set(BLOCKS)  # nothing landed: vLLM recomputes the whole prefix
    assert restorer.ended[0].miss == "stopped"


def test_a_chunk_that_misses_ends_the_restore_there(model):
    restorer, store, loads, spec, reference = _rig(model)
    store.delete(object_name(restorer.job().keys[2], "kv", 0, model.config.num_layers))
    store.gate.set()
    loads.start([spec])
    reported: set[str] = set()
    failed: set[int] = set()
    while not reported:
        done, more = loads.collect([], idle=True)
        reported |= done
        failed |= more
    assert failed == blocks_from(spec, 2 * CHUNK, BS)
    got = restorer.in_blocks()
    assert torch.equal(got[:, :, :, : 2 * CHUNK], reference[:, :, :, : 2 * CHUNK])


def _until_reported(loads: PlannedLoads) -> tuple[set[str], set[int]]:
    reported: set[str] = set()
    failed: set[int] = set()
    for _ in range(100):
        done, more = loads.collect([], idle=True)
        reported, failed = reported | done, failed | more
        if reported:
            break
    return reported, failed


def test_with_a_draft_a_restore_reruns_it_over_what_it_wrote_before_it_is_reported(model):
    restorer, store, loads, spec, reference = _rig(model)
    restorer.drafts = True
    loads.start([spec])
    assert loads.collect([], idle=False) == (set(), set()) and not restorer.reruns
    store.gate.set()
    assert _until_reported(loads) == ({"r"}, set())
    [[rerun]] = restorer.reruns
    assert rerun.spec == spec and rerun.end == N and rerun.job is not None and rerun.kv is not None
    assert torch.equal(restorer.in_blocks(), reference)


def test_with_a_draft_a_restore_is_reported_only_once_its_loads_ended_on_every_rank(model):
    restorer, store, loads, spec, _ = _rig(model)
    restorer.drafts = True
    restorer.other_rank = [0]  # the other rank's loads go on
    store.gate.set()
    loads.start([spec])
    for _ in range(100):
        assert loads.collect([], idle=True) == (set(), set())  # ended here, not there: nothing reruns yet
        if restorer.agreements[-1] == [1]:
            break
    assert restorer.agreements[-1] == [1] and not restorer.reruns and loads.in_flight == 1
    restorer.other_rank = [1]
    assert loads.collect([], idle=False) == ({"r"}, set()) and len(restorer.reruns) == 1


def test_with_a_draft_a_restore_that_cannot_start_waits_for_the_ranks_agreement_and_reruns_nothing(model):
    restorer, store, loads, spec, _ = _rig(model)
    restorer.drafts = True
    restorer.cannot_start = {"broken"}
    restorer.other_rank = [0, 0]  # started on the other rank, its loads going on there
    loads.start([LoadSpec("broken", spec.token_ids, BLOCKS, 0, load_only=True), spec])
    assert loads.collect([], idle=False) == (set(), set()) and loads.in_flight == 2
    assert restorer.agreements == [[1, 0]]  # kept, as ended, in the order the step started them
    store.gate.set()
    for _ in range(1000):  # until this rank's loads ended (the one that never started counts as ended: no wait)
        assert loads.collect([], idle=True) == (set(), set())
        if restorer.agreements[-1] == [1, 1]:
            break
        time.sleep(0.01)
    restorer.other_rank = [1, 1]
    reported, failed = loads.collect([], idle=False)
    assert reported == {"broken", "r"} and failed == set(BLOCKS)  # vLLM recomputes the one that never started
    [[broken, restored]] = restorer.reruns
    assert (broken.job, broken.kv, broken.end) == (None, None, 0) and restored.end == N


def test_with_a_draft_the_blocks_after_where_a_draft_stopped_are_recomputed(model):
    restorer, store, loads, spec, _ = _rig(model)
    restorer.drafts, restorer.draft_stops_at = True, 2 * CHUNK
    store.gate.set()
    loads.start([spec])
    assert _until_reported(loads) == ({"r"}, blocks_from(spec, 2 * CHUNK, BS))


def test_with_a_draft_a_request_vllm_finished_reruns_no_draft(model):
    restorer, store, loads, spec, _ = _rig(model)
    restorer.drafts = True
    loads.start([spec])
    assert loads.collect(["r"], idle=False) == ({"r"}, set())
    store.gate.set()
    assert not restorer.reruns


def test_with_a_draft_a_restore_that_could_not_start_and_that_vllm_finished_reports_no_blocks(model):
    """Its blocks may be another request's by then."""
    restorer, _store, loads, spec, _ = _rig(model)
    restorer.drafts, restorer.cannot_start = True, {"r"}
    restorer.other_rank = [0]  # it started on the other rank
    loads.start([spec])
    assert loads.collect([], idle=False) == (set(), set())
    restorer.other_rank = [1]
    assert loads.collect(["r"], idle=False) == ({"r"}, set()) and not restorer.reruns
