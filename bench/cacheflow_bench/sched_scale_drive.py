"""The scale benchmark's workload: one stage's batch scheduler at a fixed number of concurrent restores,
driven in simulated time, every decision timed and fingerprinted.

A closed loop, as a worker's engine sees it at a steady load: `restores` requests of `units` token chunks
each arrive at 0 s; one compute loop and `N_CHANNELS` storage channels ask the scheduler for work whenever
they are idle, and each request that finishes is replaced by a new one, so the batch holds `restores`
restores throughout. A step takes the batch-shared fixed cost once plus each unit's own (as `sim`), a
load its predicted seconds. Unit costs are GPU-like (see `GPU_COSTS`), so both pointers take units.

Only the scheduler's public interface is used: the same module times the code before and after a change.
"""

from __future__ import annotations

import hashlib
import heapq
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.sched import BatchScheduler, RequestPlan, build_plan

CHUNK = 256  # tokens per unit (the storage chunk)
STAGE_LAYERS = 8  # one stage of a 32-layer model (Llama-3-8B) split over 4 workers
KV_BYTES_PER_TOKEN_LAYER = 4096  # Llama-3-8B in bf16: 2 (K, V) x 8 KV heads x 128 dims x 2 bytes
STEP_TOKENS = 8192  # a step's token budget: vLLM's max_num_batched_tokens for chunked prefill on one H100
N_CHANNELS = 2  # storage pods
LINK_BYTES_PER_S = 25e9 / 8  # 25 Gbit/s per pod: a unit (8 MiB) loads in ~2.7 ms, about what a step of
# 32 units costs per unit, so both pointers take units
# One layer over a 256-token chunk on an H100-class GPU: 0.2 ms launched once per batch, 0.13 ms of
# per-token work, and attention that doubles the per-token work at a 16k-token context.
GPU_COSTS = CostModel(
    chunk_compute=LinearCost(fixed_s=2e-4, per_token_s=5e-7, per_token_ctx_s=5e-7 / 16384),
    layer_compute=LinearCost(fixed_s=2e-4, per_token_s=5e-7, per_token_ctx_s=5e-7 / 16384),
    load=LoadCost(bytes_per_s=LINK_BYTES_PER_S, latency_s=5e-5),
)
TICK_S = 2.0**-20  # ~1 us: unit costs are whole ticks (`_ticks`)
Scheduler = Callable[[str], Any]  # policy -> a scheduler with BatchScheduler's interface


def request_plan(index: int, units: int, arrival_s: float) -> RequestPlan:
    """The `index`-th request: `units` chunks, spread over the channels round-robin from its own offset,
    its costs in whole `TICK_S` (see `_ticks`)."""
    plan = build_plan(request_id=f"r{index}", arrival_s=arrival_s, n_tokens=units * CHUNK, costs=GPU_COSTS,
                      stage_layers=(STAGE_LAYERS,), chunk_size=CHUNK, mode="token",
                      kv_bytes_per_token_layer=KV_BYTES_PER_TOKEN_LAYER,
                      place=lambda _stage, unit: (index + unit) % N_CHANNELS)
    stages = tuple(replace(s, compute_s=_ticks(s.compute_s), fixed_s=_ticks(s.fixed_s), load_s=_ticks(s.load_s))
                   for s in plan.stages)
    return replace(plan, stages=stages)


def _ticks(costs: tuple[float, ...]) -> tuple[float, ...]:
    """Costs rounded to whole `TICK_S`: every sum of them, and so every clock reading of the loop, is then
    exact in floats. A scheduler that adds seconds in another order (the one before its incremental state
    summed in batch order) then gets the very same numbers, and any difference in decisions is a
    difference in rules, not in rounding."""
    return tuple(round(c / TICK_S) * TICK_S for c in costs)


def one_stage(policy: str) -> BatchScheduler:
    return BatchScheduler(policy, n_stages=1)


@dataclass
class Run:
    """What one closed-loop run measured: every decision's wall time, and a fingerprint of the decisions."""

    compute_ns: list[int] = field(default_factory=list)  # next_compute_batch, one per compute pick
    channel_ns: list[int] = field(default_factory=list)  # next_load, one per channel pick
    # the same decisions' CPU time (this thread's): what the machine's other jobs cannot add to
    compute_cpu_ns: list[int] = field(default_factory=list)
    channel_cpu_ns: list[int] = field(default_factory=list)
    finished: int = 0  # restores completed
    digests: dict[int, str] = field(default_factory=dict)  # compute picks made -> digest of every decision so far
    stopped_by_budget: bool = False  # the wall-time budget ended the run before `picks` compute picks


class _Fingerprint:
    """A running digest of every decision, recorded after 1, 2, 4, ... compute picks, after each of
    `checkpoints` and at the end."""

    def __init__(self, run: Run, checkpoints: Collection[int]) -> None:
        self._hash = hashlib.sha256()
        self._run = run
        self._checkpoints = checkpoints

    def add(self, text: str) -> None:
        self._hash.update(text.encode())

    def compute_pick(self) -> None:
        n = len(self._run.compute_ns)
        if n & (n - 1) == 0 or n in self._checkpoints:
            self._run.digests[n] = self._hash.hexdigest()[:16]

    def close(self) -> None:
        self._run.digests[len(self._run.compute_ns)] = self._hash.hexdigest()[:16]


def drive(policy: str, restores: int, units: int, *, picks: int, budget_s: float = float("inf"),
          scheduler: Scheduler = one_stage, checkpoints: Collection[int] = ()) -> Run:
    """Run the closed loop until `picks` compute picks were made, or `budget_s` of wall time went by; the
    decisions' digest is also recorded after each number of compute picks in `checkpoints`."""
    sched = scheduler(policy)
    run = Run()
    digest = _Fingerprint(run, checkpoints)
    plans: dict[str, RequestPlan] = {}
    arrivals = 0

    def arrive(now: float) -> None:
        nonlocal arrivals
        plan = request_plan(arrivals, units, now)
        arrivals += 1
        plans[plan.request_id] = plan
        sched.arrive(plan)

    for _ in range(restores):
        arrive(0.0)
    events: list[tuple[float, int, str, Any]] = []  # (time, sequence, kind, what)
    sequence = 0
    stage_busy = False
    loading: list[Any] = [None] * N_CHANNELS
    now = 0.0
    deadline = time.perf_counter() + budget_s
    while len(run.compute_ns) < picks:
        if time.perf_counter() > deadline:
            run.stopped_by_budget = True
            break
        if not stage_busy:
            cpu, started = time.thread_time_ns(), time.perf_counter_ns()
            batch = sched.next_compute_batch(0, STEP_TOKENS, now=now)
            run.compute_ns.append(time.perf_counter_ns() - started)
            run.compute_cpu_ns.append(time.thread_time_ns() - cpu)
            digest.add(f"c{now!r}:{','.join(f'{t.request_id}/{t.unit}' for t in batch)};")
            digest.compute_pick()
            if batch:
                stage_busy = True
                seconds = _step_seconds([plans[t.request_id].stages[0] for t in batch], [t.unit for t in batch])
                heapq.heappush(events, (now + seconds, sequence, "step", (batch, seconds)))
                sequence += 1
        for channel in range(N_CHANNELS):
            if loading[channel] is None:
                cpu, started = time.thread_time_ns(), time.perf_counter_ns()
                task = sched.next_load(channel, now)
                run.channel_ns.append(time.perf_counter_ns() - started)
                run.channel_cpu_ns.append(time.thread_time_ns() - cpu)
                digest.add(f"l{channel}:{task};")
                if task is not None:
                    loading[channel] = task
                    load_s = plans[task.request_id].stages[0].load_s[task.unit]
                    heapq.heappush(events, (now + load_s, sequence, "load", channel))
                    sequence += 1
        if not events:
            raise RuntimeError(f"{policy}: nothing in flight and nothing to do at {now} s")
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, kind, what = heapq.heappop(events)
            if kind == "step":
                batch, seconds = what
                stage_busy = False
                sched.step_done(0, seconds)
                for task in batch:
                    sched.computed(0, task.request_id, task.unit)
            else:
                task, loading[what] = loading[what], None
                sched.loaded(0, task.request_id, task.unit, now)
        for request_id in sched.finished():
            sched.forget(request_id)
            del plans[request_id]
            run.finished += 1
            arrive(now)
    digest.close()
    return run


def _step_seconds(stage_plans: list[Any], units: list[int]) -> float:
    """A step's seconds: every unit's own cost, with the batch-shared fixed part paid once (as `sim`)."""
    fixed = [p.fixed_s[u] for p, u in zip(stage_plans, units, strict=True)]
    return sum(p.compute_s[u] for p, u in zip(stage_plans, units, strict=True)) - sum(fixed) + max(fixed)
