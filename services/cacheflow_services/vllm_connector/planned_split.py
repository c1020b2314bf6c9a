"""Restores whose meeting point is planned before they start: on tensor-parallel ranks, and by loads alone.

Recomputing with vLLM's model on a tensor-parallel rank runs its collectives, so every rank must run the
same forwards, of the same sizes, in the same order. The two-pointer restore decides how far compute goes
as loads land, differently on each rank, and a rank that computed one unit more would wait forever on the
others. So a tensor-parallel rank plans its meeting point up front from the prefix's chunks, the profile's
costs and the policy: the split that ends first by the bound's formula (`best_split`), its predicted times
scaled by what this rank measured (each chunk's load, each step's fronts: the worker's `calibration`). The
ranks' measurements differ, so they agree on the latest meeting point, which the slowest rank's loads need
(`latest_fronts`). Each recomputes the chunks before it with vLLM's model (`planned_fronts.py`: the fronts of
restores that start in one step share forwards, spread over vLLM's steps as its chunked prefill spreads a
prompt), while a thread loads the chunks from it on (its own slice of the KV heads, keyed by its rank). A chunk
that misses ends the restore there: vLLM recomputes from its first block on, on every rank together (vLLM
takes the union of the ranks' failed blocks), so the forwards never depend on a load.

Without a profile there is no cost to plan with, and where nothing may recompute beside vLLM (LoRA:
`connector.py` says why) the front is empty: every chunk is loaded, front to back, up to the first miss.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from cacheflow_common.restore.costs import CostModel, best_split
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.sched.plan import chunk_costs
from cacheflow_common.sched.policies import Policy
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.draft import keep_draft_rows
from cacheflow_services.vllm_connector.planned_fronts import Fronts, front_inputs
from cacheflow_services.vllm_connector.ranks import ONE_RANK, RowShare
from cacheflow_services.vllm_connector.vllm_runtime import VllmRuntime


class SplitPlan(NamedTuple):
    """One planned restore: positions [start, front) recomputed into `kv`, the job's chunks from `front` on loaded."""

    job: RestoreJob
    kv: BlockKV
    start: int
    front: int
    load_s: Sequence[float] = ()  # each of the job's chunks' predicted load seconds, uncalibrated (none: unknown)


class Split(NamedTuple):
    end: int  # tokens [0, end) are in the blocks
    computed: int  # chunks recomputed
    loaded: int  # chunks loaded
    bytes_read: int
    miss: str  # why the chunk at `end` missed, or "" (all restored)
    batch: int = 1  # restores started together (their fronts shared forwards)
    timed: tuple[tuple[float, float], ...] = ()  # per chunk loaded, in order: (predicted, measured) seconds
    front_steps: int = 0  # vLLM steps its front's forwards took
    boundary_bytes_read: int = 0  # a later pipeline rank's: the boundary activations it read for the front

    @property
    def load_s(self) -> float:
        """Measured: from the loads' start until the last chunk loaded landed."""
        return sum(measured for _, measured in self.timed)

    @property
    def predicted_load_s(self) -> float:
        """The chunks loaded, as their plan predicted them (0: no prediction)."""
        return sum(predicted for predicted, _ in self.timed)


def chunk_load_times(job: RestoreJob, costs: CostModel, kv_bytes: int, row_bytes: int = 0) -> list[float]:
    """Each of the job's chunks' predicted load seconds (`kv_bytes`: one token's KV in one layer, as stored;
    `row_bytes`: one token's rows a draft reads, read with it: `start_splits`' `draft_sources`)."""
    return [costs.chunk_load_s(key.n_tokens * (len(job.layers) * kv_bytes + row_bytes)) for key in job.keys]


def planned_front(job: RestoreJob, *, start: int, costs: CostModel | None, policy: Policy,
                  load_s: Sequence[float], compute_scale: float = 1.0) -> int:
    """The position the loads start from: chunks before it are recomputed, the others loaded (a policy that
    fixes the split fixes it here too). `start`: the first position vLLM does not hold; `load_s`: each of the
    job's chunks' load seconds, as expected (`chunk_load_times`, calibrated); `compute_scale`: measured / predicted
    compute seconds."""
    if costs is None or not policy.computes_pending:
        return start
    units = [unit for unit, key in enumerate(job.keys) if key.token_end > start]
    if not units:
        return start
    if not policy.loads:
        return job.keys[units[-1]].token_end
    compute_s = chunk_compute_times(job, start, costs)
    k, _ = best_split([compute_s[unit] * compute_scale for unit in units], [load_s[unit] for unit in units])
    return job.keys[units[k - 1]].token_end if k else start


def chunk_compute_times(job: RestoreJob, start: int, costs: CostModel) -> list[float]:
    """Each of the job's chunks' predicted seconds to recompute its positions from `start` on (uncalibrated)."""
    n_layers = len(job.layers)
    return [chunk_costs(costs, max(key.token_start, start), key.token_end, n_layers)[0] if key.token_end > start
            else 0.0 for key in job.keys]


def front_compute_s(plan: SplitPlan, costs: CostModel) -> float:
    """The predicted seconds (uncalibrated) to recompute the plan's front, positions [start, front)."""
    compute_s = chunk_compute_times(plan.job, plan.start, costs)
    return sum(seconds for key, seconds in zip(plan.job.keys, compute_s, strict=True) if key.token_end <= plan.front)


def latest_fronts(plans: Sequence[SplitPlan | BaseException], agree_min: Callable[[list[int]], list[int]]
                  ) -> list[SplitPlan | BaseException]:
    """The plans with each one's latest front over the tensor-parallel ranks (`agree_min`: a MIN over them): each
    rank's fronts follow its own loads' measurements, and the slowest rank's loads need the latest. Every rank
    calls it with the same restores, in the same order (a plan that failed to be made counts for none)."""
    latest = agree_min([-plan.front if isinstance(plan, SplitPlan) else 0 for plan in plans])
    return [plan._replace(front=-front) if isinstance(plan, SplitPlan) else plan
            for plan, front in zip(plans, latest, strict=True)]


def restore_split(job: RestoreJob, store: ChunkStore, kv: BlockKV, model: VllmRuntime | None, *, start: int,
                  front: int, prefill_tokens: int, load_s: Sequence[float] = (),
                  draft_sources: Sequence[tuple[int, str]] = ()) -> Split:
    """Recompute positions [start, front) with vLLM's `model` while a thread loads the job's chunks from
    `front` on, in order, until one misses (each written into the blocks as it lands); returns once both end.
    `load_s`: each chunk's predicted load seconds, as `SplitPlan`'s; `draft_sources`: as `start_splits`'."""
    [running] = start_splits([SplitPlan(job, kv, start, front, load_s)], store, model, prefill_tokens=prefill_tokens,
                             draft_sources=draft_sources)
    running.join()
    return running.result()


def start_splits(plans: Sequence[SplitPlan], store: ChunkStore, model: VllmRuntime | None, *, prefill_tokens: int,
                 step_tokens: int | None = None, on_loaded: Callable[[], None] = lambda: None,
                 agree: Callable[[bool], bool] = lambda ok: ok, draft_sources: Sequence[tuple[int, str]] = (),
                 on_fronts_done: Callable[[float], None] = lambda seconds: None,
                 row_share: RowShare = ONE_RANK) -> list[RunningSplit]:
    """Start every plan's back loading on a thread of its own, recompute the first step of their fronts
    (positions [start, front)) together with vLLM's model meanwhile (`step_tokens`: the most front tokens a
    step takes, None: all), and return with the loads still running and the rest of the fronts in the splits'
    shared `fronts`, one step per later `Fronts.step` (`on_loaded`: called on a load thread once its loads end;
    `agree`: whether every tensor-parallel rank read its fronts' inputs, see `front_inputs`; `draft_sources`: the
    stored rows a draft reads, each (layer, kind): read with each chunk loaded and kept with the plan's KV, where
    its rerun finds them (under tensor parallelism the chunks `row_share` gives this rank, as are a later pipeline
    rank's fronts' boundary activations); `on_fronts_done`:
    `Fronts`' `on_done`). Fronts that fail in this step stop every
    plan's loads (and seal its blocks) first."""
    fronts = Fronts(plans, front_inputs(plans, store, model, agree, row_share), model, prefill_tokens=prefill_tokens,
                    step_tokens=step_tokens, on_done=on_fronts_done)
    loads = [BackLoads(KVLoader(store=store, keys=plan.job.keys, layers=plan.job.layers, kv=plan.kv,
                                dtype=plan.job.kv_dtype, quant=plan.job.quant, heads=plan.job.heads),
                       [unit for unit, key in enumerate(plan.job.keys) if key.token_end > max(plan.start, plan.front)],
                       on_loaded, keep_draft_rows(plan.job, plan.kv, store, draft_sources, row_share))
             for plan in plans]
    running = [RunningSplit(plan.job, plan.kv, back, _chunks_between(plan.job, plan.start, plan.front),
                            max(plan.start, plan.front), batch=len(plans), predicted_s=plan.load_s,
                            fronts=fronts, plan=i)
               for i, (plan, back) in enumerate(zip(plans, loads, strict=True))]
    if fronts.pending:
        try:
            fronts.step()
        except BaseException:
            stop_fronts(running)
            raise
    return running


def stop_fronts(splits: Sequence[RunningSplit]) -> None:
    """Splits whose shared fronts failed: their loads stop and their blocks are sealed (vLLM recomputes them)."""
    for split in splits:
        split.loads.stop()
        split.kv.seal()


class BackLoads:
    """A planned restore's back: its chunks loaded in order on a thread of its own, until one misses or `stop`."""

    def __init__(self, loader: KVLoader, units: list[int], on_loaded: Callable[[], None],
                 after_chunk: Callable[[int], None] = lambda unit: None) -> None:
        self.loader = loader
        self.units = units
        self.reasons: list[str] = []  # each chunk's miss reason ("": loaded), in order, up to the first miss
        self.landed_s: list[float] = []  # when each of `reasons` was known, in seconds from the loads' start
        self._stopped = threading.Event()
        self._ended = threading.Event()
        self._on_loaded = on_loaded
        self._after_chunk = after_chunk  # after each chunk loaded, on the thread (and in its time)
        self._thread = threading.Thread(target=self._run, name="cacheflow-planned-loads", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            for unit in self.units:
                if self._stopped.is_set():
                    return
                reason = self.loader.load_chunk(unit)
                if not reason:
                    self._after_chunk(unit)
                self.landed_s.append(time.perf_counter() - started)  # before `reasons`: read after it
                self.reasons.append(reason)
                if self.reasons[-1]:
                    return
        finally:
            self._ended.set()
            self._on_loaded()

    def stop(self) -> None:
        """Load no further chunk (one being read goes on: seal the blocks to keep it out of them)."""
        self._stopped.set()

    @property
    def ended(self) -> bool:
        """No chunk loads any more (the thread may still be on its way out)."""
        return self._ended.is_set()

    def join(self) -> None:
        self._thread.join()


class RunningSplit:
    """A planned restore whose front is in the blocks and whose back may still be loading."""

    def __init__(self, job: RestoreJob, kv: BlockKV, loads: BackLoads, computed: int, front: int, *,
                 batch: int = 1, predicted_s: Sequence[float] = (), fronts: Fronts | None = None,
                 plan: int = 0) -> None:
        self.job = job
        self.kv = kv
        self.loads = loads
        self.computed = computed
        self.front = front  # the back's loads start here
        self.batch = batch  # restores started with it
        self.predicted_s = predicted_s  # each of the job's chunks' predicted load seconds (none: unknown)
        self.fronts = fronts  # the fronts it shares with the restores started with it (None: it has none)
        self.plan = plan  # its place among them

    @property
    def failed(self) -> BaseException | None:
        """What its front's forwards raised (its loads are stopping, its blocks sealed), if they failed."""
        return self.fronts.error if self.fronts is not None else None

    @property
    def ended(self) -> bool:
        """Its front is in the blocks (or failed) and no chunk loads any more."""
        return (self.fronts is None or not self.fronts.pending) and self.loads.ended

    def join(self) -> None:
        """Wait for its loads (its front must be done: `Fronts.step`)."""
        self.loads.join()

    def result(self, *, stop: bool = False) -> Split:
        """What is in the blocks, which no load writes into once this returns (`stop`: load no further chunk;
        a write in progress finishes first): the front, then the chunks loaded in order up to the first miss,
        or up to the last one landed by now (those landing meanwhile count as missed: vLLM recomputes them)."""
        if stop:
            self.loads.stop()
        reasons = list(self.loads.reasons)  # before the seal: each was written before it was listed
        self.kv.seal()
        hits = reasons[:-1] if reasons and reasons[-1] else reasons
        units = self.loads.units
        end = self.job.keys[units[len(hits) - 1]].token_end if hits else self.front
        miss = reasons[-1] if reasons and reasons[-1] else ("stopped" if len(hits) < len(units) else "")
        landed = [0.0, *self.loads.landed_s[: len(hits)]]
        timed = tuple((self.predicted_s[unit] if self.predicted_s else 0.0, landed[i + 1] - landed[i])
                      for i, unit in enumerate(units[: len(hits)]))
        steps, boundary = ((self.fronts.plan_steps[self.plan], self.fronts.boundary_bytes_read[self.plan])
                           if self.fronts is not None else (0, 0))
        return Split(end, self.computed, len(hits), self.loads.loader.bytes_read, miss, self.batch, timed, steps,
                     boundary)


def _chunks_between(job: RestoreJob, start: int, front: int) -> int:
    """The chunks a front [start, front) recomputes."""
    return sum(1 for key in job.keys if start < key.token_end <= front)
