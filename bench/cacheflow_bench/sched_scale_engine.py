"""The scale benchmark's engine part: a stage engine restoring many requests at once on the tiny model, its
compute loop's steps timed, and the scheduler's share of them.

The engine is the one the workers, the vLLM connector and the library run (`cacheflow_common.engine`):
its compute loop either on a thread of its own (a stage worker's) or on the thread that asks for the
restores (the connector's and the library's). Each step schedules (the batch scheduler's compute pick,
under the lock the channel threads share), runs one batched forward and reports what it computed; the
channels' picks take the same lock. The scheduler is handed to the engine instrumented (`TimedScheduler`);
a step's time is its compute pick and what it ran (`on_step`). The tiny model keeps the forward small, so
this is where the scheduler's share of a step is largest.

Every request restores the same prefix (stored once): `RESTORE_UNITS` chunks of `CHUNK` tokens, loaded
through a shaped link slow enough that compute and both channels all take units.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from cacheflow_common.engine import Engine, EngineSettings, StepPlan
from cacheflow_common.model.sources import load_model
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.restore.save import make_job, save_prefix
from cacheflow_common.sched.policies import make_policy
from cacheflow_common.sched.scheduler import BatchScheduler
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.shaped import ShapedStore
from cacheflow_common.transport.shaping import TokenBucket

CHUNK = 16  # tokens per unit: the smallest sensible chunk, so each unit's compute is small
RESTORE_UNITS = 4  # units per request (a 64-token prefix): 128 restores stay within seconds of compute
LINK_BYTES_PER_S = 4e6  # a unit of the tiny model's KV (128 KiB in float32) loads in ~33 ms
# Rough costs of the tiny model on a CPU core, per layer: enough for the meeting point to plan with.
TINY_COSTS = CostModel(
    chunk_compute=LinearCost(fixed_s=2e-4, per_token_s=4e-5, per_token_ctx_s=1e-8),
    layer_compute=LinearCost(fixed_s=2e-4, per_token_s=4e-5, per_token_ctx_s=1e-8),
    load=LoadCost(bytes_per_s=LINK_BYTES_PER_S, latency_s=1e-4),
)


def _timed(calls: list[float], method: Callable[..., Any], *, when: Callable[[Any], bool] = lambda _: True
           ) -> Callable[..., Any]:
    """`method`, its wall time appended to `calls` each time it returns a value `when` accepts."""
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        result = method(*args, **kwargs)
        if when(result):
            calls.append(time.perf_counter() - started)
        return result

    return timed


class TimedScheduler(BatchScheduler):
    """A batch scheduler that times its compute picks that start a step, and its channels' picks."""

    def __init__(self, policy: str) -> None:
        super().__init__(make_policy(policy), n_stages=1)
        self.picks: list[float] = []
        self.loads: list[float] = []
        self.next_compute_batch = _timed(  # type: ignore[method-assign]
            self.picks, super().next_compute_batch, when=bool)
        self.next_load = _timed(self.loads, super().next_load)  # type: ignore[method-assign]


def step_share(policy: str, restores: int, *, loop_thread: bool) -> dict[str, Any]:
    """One batch of `restores` restores through an engine; its steps and the scheduler's share of them."""
    torch.set_num_threads(1)
    model = load_model("tiny", dtype=torch.float32)
    job = make_job(model, [(7 * i) % model.config.vocab_size for i in range(CHUNK * RESTORE_UNITS)],
                   tenant="bench", chunk_size=CHUNK)
    inner = MemoryStore()
    save_prefix(model, job, inner)
    store = ShapedStore(inner, TokenBucket(LINK_BYTES_PER_S))
    settings = EngineSettings(layers=range(model.config.num_layers), policy=policy, chunk_size=CHUNK,
                              costs=TINY_COSTS, channels=("pod-0", "pod-1"))
    steps: list[float] = []
    scheduler = TimedScheduler(policy)
    picks, loads = scheduler.picks, scheduler.loads

    def step_ran(plan: StepPlan, seconds: float) -> None:
        steps.append(picks[-1] + seconds)  # no forward work here: every step starts with a pick

    make = Engine.for_stage if loop_thread else Engine.for_connector
    with make(settings, model, on_step=step_ran, scheduler=scheduler) as engine:
        started = time.perf_counter()
        results = engine.restore_batch({f"r{i}": job for i in range(restores)}, store, policy)
        wall = time.perf_counter() - started
    failed = [r for r in results.values() if isinstance(r, Exception)]
    if failed:
        raise RuntimeError(f"{len(failed)} restores failed, e.g. {failed[0]!r}")
    computed = sum(r.sources().count("computed") for r in results.values() if not isinstance(r, Exception))
    return {
        "mode": "worker (own loop thread)" if loop_thread else "connector (caller's thread)",
        "policy": policy, "restores": restores, "units": restores * RESTORE_UNITS, "units_computed": computed,
        "wall_s": wall, "steps": len(steps),
        "step_ms_median": 1e3 * statistics.median(steps), "step_ms_total": 1e3 * sum(steps),
        "compute_pick_ms_median": 1e3 * statistics.median(picks), "compute_pick_ms_worst": 1e3 * max(picks),
        "channel_pick_ms_median": 1e3 * statistics.median(loads), "channel_pick_ms_worst": 1e3 * max(loads),
        # every compute pick runs inside a step: the scheduler's share of the loop's time in steps
        "sched_share": sum(picks) / sum(steps),
    }
