"""The discrete-event simulator: the batch scheduler drives simulated stages and storage channels.

Resources: S stages, each running one compute batch at a time, and M storage pods, each sending over
one link (`latency + bytes / rate` for a load alone; loads in flight on one pod share its link). Who
schedules what (`SimConfig.scheduling`):

* `per-stage` — as the stage workers' engines run: every stage has its own scheduler for its own
  units and a loader per pod of its own, so S loaders share each pod's link;
* `cluster` — an idealised cluster-wide scheduler: one for every stage, and one loader per pod.

Time is simulated only: events wait in a heap. The loop reads like the worker's:

    pop the next events (arrivals, batches done, loads done: all at that instant), report them
    -> admit queued requests into free slots (max batch, arrival order), as the coordinator does: a
       batch forms `batch_window_s` after the first waiting request arrived, or at once when enough
       wait to fill the free slots; a request holds its slot from admission to its first token
    -> start every idle stage and channel on what the scheduler decides

A stage's compute batch holds the restore units the scheduler chose plus one suffix-prefill chunk of
every request waiting at that stage (chunked prefill, `prefill_tokens` tokens). It costs the batch-shared
fixed part once (the largest among its items: per-layer launch costs) plus each item's own per-token
and attention terms (with `batched_compute` off, every item pays its own fixed part too). A request's
suffix enters stage 0 when its restore is done (plus `restore_overhead_s`), chunk by chunk; each chunk
moves on to the next stage after it (a pipeline), and the first token is out when the last chunk
leaves the last stage. Costs are the cost model's predictions, so the plan the policy ranks by is
exact here.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import itertools
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from cacheflow_common.errors import CacheFlowError, ConfigError
from cacheflow_common.sched.plan import Placement, RequestPlan, build_plan, chunk_costs
from cacheflow_common.sched.policies import choose_mode, make_policy, token_unit
from cacheflow_common.sched.scheduler import BatchScheduler, ComputeTask, LoadTask
from cacheflow_common.sim.config import SimConfig
from cacheflow_common.sim.links import SharedLink
from cacheflow_common.sim.result import RequestResult, SimResult
from cacheflow_common.sim.trace import TraceRequest


class SimulationStalledError(CacheFlowError):
    """The event heap ran dry with requests unfinished: a scheduling bug, never a slow policy."""


def simulate(trace: Sequence[TraceRequest], config: SimConfig) -> SimResult:
    """Replay `trace` on the cluster `config` describes; every request is restored and prefilled."""
    return _Simulation(trace, config).run()


class _PrefillChunk(NamedTuple):
    request_id: str
    start: int  # token range of the suffix chunk
    end: int


@dataclass
class _Batch:
    tasks: list[ComputeTask]
    prefills: list[_PrefillChunk]


class _Simulation:
    def __init__(self, trace: Sequence[TraceRequest], config: SimConfig) -> None:
        self.config = config
        self.costs = config.link_costs()
        self.layers = config.layer_split()
        self.policy = make_policy(config.policy)
        per_stage = config.scheduling == "per-stage"
        self.schedulers = ([BatchScheduler(self.policy, n_stages=1) for _ in self.layers] if per_stage
                           else [BatchScheduler(self.policy, n_stages=len(self.layers))])
        # Loaders: (scheduler, pod); every scheduler has one per pod.
        self.loaders = [(k, pod) for k in range(len(self.schedulers)) for pod in range(config.n_channels)]
        self.links = [SharedLink() for _ in range(config.n_channels)]
        self.trace = {r.request_id: r for r in trace}
        if len(self.trace) != len(trace):
            raise ConfigError("the trace holds a request id twice")
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._queue: deque[str] = deque()  # arrived, waiting for a slot
        self._running: set[str] = set()  # admitted, first token not out yet (each holds a slot)
        self._plans: dict[str, RequestPlan] = {}
        self._admitted_s: dict[str, float] = {}
        self._restored_s: dict[str, float] = {}
        self._first_token_s: dict[str, float] = {}
        self._computed: defaultdict[str, float] = defaultdict(float)
        self._loaded: defaultdict[str, float] = defaultdict(float)
        self._batches: list[_Batch | None] = [None] * len(self.layers)
        self._prefills: list[dict[str, deque[_PrefillChunk]]] = [{} for _ in self.layers]  # chunks waiting
        self._loads: list[LoadTask | None] = [None] * len(self.loaders)  # each loader's load in flight
        self._stage_busy = [0.0] * len(self.layers)
        # Idle resources an event may have given work to (the others have none: no need to ask).
        self._wake_stages: set[int] = set()
        self._wake_channels: set[int] = set()

    def run(self) -> SimResult:
        for request in self.trace.values():
            self._at(request.arrival_s, functools.partial(self._queue.append, request.request_id))
            if self.config.batch_window_s > 0:  # a batch may form when the window of this arrival closes
                self._at(request.arrival_s + self.config.batch_window_s, lambda: None)
        while self._events:
            self.now = self._events[0][0]
            while self._events and self._events[0][0] == self.now:  # everything that happens at this instant
                heapq.heappop(self._events)[2]()
            self._admit()
            self._dispatch()
        return self._result()

    def _at(self, time_s: float, handle: Callable[[], None]) -> None:
        heapq.heappush(self._events, (time_s, next(self._seq), handle))

    # -- admission and completion ---------------------------------------------------------------
    def _admit(self) -> None:
        free = self.config.max_batch - len(self._running)
        if not self._queue or free <= 0:
            return
        window_open = self.now < self.trace[self._queue[0]].arrival_s + self.config.batch_window_s
        if window_open and len(self._queue) < free:
            return  # more may join this batch
        for _ in range(min(free, len(self._queue))):
            rid = self._queue.popleft()
            self._plans[rid] = plan = self._plan(self.trace[rid], order=len(self._plans))
            self._admitted_s[rid] = self.now
            self._running.add(rid)
            for k, scheduler in enumerate(self.schedulers):
                scheduler.arrive(self._part(plan, k))
            self._wake_stages.update(range(len(self.layers)))
            self._wake_channels.update(range(len(self.loaders)))
            self._check_restored(rid)  # an empty prefix is restored at once

    def _plan(self, request: TraceRequest, *, order: int) -> RequestPlan:
        return build_plan(
            request_id=request.request_id,
            arrival_s=request.arrival_s,
            n_tokens=request.cached_tokens,
            costs=self.costs,
            stage_layers=self.layers,
            chunk_size=token_unit(self.policy, self.config.chunk_size, self.config.prefill_tokens),
            mode=choose_mode(self.policy, request.cached_tokens, self.config.l_delta, pipeline=len(self.layers) > 1),
            kv_bytes_per_token_layer=self.config.model.kv_bytes_per_token_layer,
            place=self._placement(request.request_id, order),
        )

    def _part(self, plan: RequestPlan, k: int) -> RequestPlan:
        """What scheduler `k` schedules of a request: all of it, or (per stage) its stage's units."""
        if len(self.schedulers) == 1:
            return plan
        return replace(plan, stages=(plan.stages[k],))

    def _scheduler_of(self, stage: int) -> tuple[BatchScheduler, int]:
        """The scheduler of `stage`, and the stage's number there."""
        return (self.schedulers[stage], 0) if len(self.schedulers) > 1 else (self.schedulers[0], stage)

    def _stage_in(self, k: int, local: int) -> int:
        """The pipeline stage of scheduler `k`'s stage `local`."""
        return k if len(self.schedulers) > 1 else local

    def _is_restored(self, rid: str) -> bool:
        return all(scheduler.is_finished(rid) for scheduler in self.schedulers)

    def _placement(self, request_id: str, order: int) -> Placement:
        return placement(self.config, request_id, order)

    def _check_restored(self, rid: str) -> None:
        if rid not in self._restored_s and self._is_restored(rid):
            overhead = self.config.restore_overhead_s if self.trace[rid].cached_tokens else 0.0
            self._restored_s[rid] = self.now + overhead
            self._at(self._restored_s[rid], functools.partial(self._prefill_after_restore, rid))

    def _prefill_after_restore(self, rid: str) -> None:
        """The restore is reported done: the suffix enters stage 0 (the first token, if there is none)."""
        request = self.trace[rid]
        if request.input_length == request.cached_tokens:
            self._first_token(rid)
        size = self.config.prefill_tokens  # a worker runs the suffix as one item, in budget-sized slices
        for start in range(request.cached_tokens, request.input_length, size):
            end = min(start + size, request.input_length)
            self._queue_prefill(0, _PrefillChunk(rid, start, end))

    # -- stages ----------------------------------------------------------------------------------
    def _start_batch(self, stage: int) -> None:
        prefills = self._take_prefill_chunks(stage)
        cap = self.config.max_batch_tokens
        room = None if cap is None else max(0, cap - sum(c.end - c.start for c in prefills))
        light = self.config.beside_forward_tokens
        if prefills and light is not None:  # the engine runs forward work in light steps
            room = light if room is None else min(room, light)
        scheduler, local = self._scheduler_of(stage)
        tasks = scheduler.next_compute_batch(local, room, now=self.now)
        if not tasks and not prefills:
            return
        items = [self._unit_costs(stage, t) for t in tasks] + [self._prefill_costs(stage, c) for c in prefills]
        seconds = sum(total for total, _ in items)
        if self.config.batched_compute:  # the batch-shared fixed part once, not once per item
            seconds -= sum(fixed for _, fixed in items) - max(fixed for _, fixed in items)
        if any(load is not None for load in self._loads):  # loaders take time from the compute loop's cores
            seconds *= self.config.compute_slowdown_while_loading
        batch = self._batches[stage] = _Batch(tasks, prefills)
        self._stage_busy[stage] += seconds
        self._at(self.now + seconds, lambda: self._batch_done(stage, batch, seconds))

    def _unit_costs(self, stage: int, task: ComputeTask) -> tuple[float, float]:
        plan = self._plans[task.request_id].stages[stage]
        return plan.compute_s[task.unit], plan.fixed_s[task.unit]

    def _prefill_costs(self, stage: int, chunk: _PrefillChunk) -> tuple[float, float]:
        return chunk_costs(self.costs, chunk.start, chunk.end, self.layers[stage])

    def _queue_prefill(self, stage: int, chunk: _PrefillChunk) -> None:
        self._prefills[stage].setdefault(chunk.request_id, deque()).append(chunk)
        self._wake_stages.add(stage)

    def _take_prefill_chunks(self, stage: int) -> list[_PrefillChunk]:
        """The next suffix chunk of every request waiting at `stage` (its earlier chunks ran before)."""
        waiting = self._prefills[stage]
        chunks = [queue.popleft() for queue in waiting.values()]
        for rid in [rid for rid, queue in waiting.items() if not queue]:
            del waiting[rid]
        return chunks

    def _batch_done(self, stage: int, batch: _Batch, seconds: float) -> None:
        self._batches[stage] = None
        scheduler, local = self._scheduler_of(stage)
        scheduler.step_done(local, seconds)
        self._wake_stages.add(stage)
        for task in batch.tasks:
            if scheduler.computed(local, task.request_id, task.unit):
                self._computed[task.request_id] += self._plans[task.request_id].unit_tokens(stage, task.unit)
                self._check_restored(task.request_id)
        for chunk in batch.prefills:
            if stage + 1 < len(self.layers):
                self._queue_prefill(stage + 1, chunk)
            elif chunk.end == self.trace[chunk.request_id].input_length:
                self._first_token(chunk.request_id)

    def _first_token(self, rid: str) -> None:
        """The request's first token is out: its slot is free for the next in the queue."""
        self._first_token_s[rid] = self.now
        self._running.discard(rid)

    # -- loaders and links -----------------------------------------------------------------------
    def _start_load(self, loader: int) -> None:
        k, pod = self.loaders[loader]
        task = self.schedulers[k].next_load(pod, self.now)
        if task is None:
            return
        stage = self._stage_in(k, task.stage)
        self._loads[loader] = task
        self.links[pod].start(loader, self._plans[task.request_id].stages[stage].load_s[task.unit], self.now)
        self._plan_completion(pod)

    def _plan_completion(self, pod: int) -> None:
        """Schedule the pod's next load completion; any change to the pod makes an earlier plan stale."""
        link = self.links[pod]
        upcoming = link.next_completion(self.now)
        if upcoming is not None:
            at, loader = upcoming
            version = link.version
            self._at(at, lambda: self._load_done(pod, loader) if link.version == version else None)

    def _load_done(self, pod: int, loader: int) -> None:
        task = self._loads[loader]
        if task is None:
            return
        self._loads[loader] = None
        self.links[pod].finish(loader, self.now)
        self._plan_completion(pod)
        k, _ = self.loaders[loader]
        stage = self._stage_in(k, task.stage)
        self._wake_channels.add(loader)
        self._wake_stages.add(stage)  # a landed unit may unblock that stage's compute pointer
        if self.schedulers[k].loaded(task.stage, task.request_id, task.unit, self.now):
            self._loaded[task.request_id] += self._plans[task.request_id].unit_tokens(stage, task.unit)
            self._check_restored(task.request_id)

    def _dispatch(self) -> None:
        """Start every woken idle stage and channel on what the scheduler decides."""
        for stage in sorted(self._wake_stages):
            if self._batches[stage] is None:
                self._start_batch(stage)
        for loader in sorted(self._wake_channels):
            if self._loads[loader] is None:
                self._start_load(loader)
        self._wake_stages.clear()
        self._wake_channels.clear()

    # -- the report ------------------------------------------------------------------------------
    def _result(self) -> SimResult:
        unfinished = sorted(set(self.trace) - set(self._first_token_s))
        if unfinished:
            raise SimulationStalledError(f"{len(unfinished)} requests never finished, e.g. {unfinished[:5]}")
        t0 = min((r.arrival_s for r in self.trace.values()), default=0.0)
        return SimResult(
            policy=self.config.policy,
            requests=tuple(self._request_result(rid) for rid in self.trace),
            stage_busy_s=tuple(self._stage_busy),
            channel_busy_s=tuple(link.busy_s for link in self.links),
            makespan_s=self.now - t0,
        )

    def _request_result(self, rid: str) -> RequestResult:
        request = self.trace[rid]
        admitted = self._admitted_s[rid]
        return RequestResult(
            request_id=rid,
            mode=self._plans[rid].mode,
            arrival_s=request.arrival_s,
            queue_s=admitted - request.arrival_s,
            restore_s=self._restored_s[rid] - admitted,
            ttft_s=self._first_token_s[rid] - request.arrival_s,
            cached_tokens=request.cached_tokens,
            tokens_computed=self._computed[rid],
            tokens_loaded=self._loaded[rid],
        )


def placement(config: SimConfig, request_id: str, order: int) -> Placement:
    """Which channel holds each (stage, unit) of the `order`-th request admitted."""
    m = config.n_channels
    if config.placement == "hash":
        return lambda s, u: _stable_hash(f"{request_id}/{s}/{u}") % m
    return lambda s, u: (order + s + u) % m


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
