"""Random workloads played against two batch schedulers at once: the product's and the oracle (the scheduler
before its incremental state, `tests/common/sched_oracle`). Every decision and every event's answer must be
the same from both; a mismatch fails at the first decision that differs.

A driver plays the stages and the storage channels: it asks for compute batches (random token budgets, a
random `ready` predicate) and loads, keeps them in flight on a clock, and reports them done, missed or
late, with arrivals (each request with its own policy, if `mixed`), step times, lost channels, lost
stages and cancels mixed in. Costs come in two kinds: `float` (random, as a cost model's: no two sums tie)
and `exact` (small powers of two, every request alike: ties everywhere, and every sum is exact in floats,
so the two schedulers' arithmetic cannot differ).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from cacheflow_common.sched import NOT_STORED, POLICIES, BatchScheduler, RequestPlan, StagePlan
from cacheflow_common.sched.scheduler import ComputeTask, LoadTask
from tests.common.sched_oracle import BatchScheduler as OracleScheduler

COSTS = ("float", "exact")


def random_plans(rng: random.Random, n_requests: int, n_stages: int, n_channels: int, costs: str) -> list[RequestPlan]:
    """Requests of random modes and lengths, units on random channels (some stored nowhere)."""
    plans = []
    for i in range(n_requests):
        mode = rng.choice(("token", "layer"))
        n_chunks = rng.randint(1, 12)
        stages = []
        for _ in range(n_stages):
            n = n_chunks if mode == "token" else rng.randint(1, 12)
            if costs == "exact":
                compute = (rng.choice((0.5, 1.0, 2.0)),) * n
                load: tuple[float, ...] = (rng.choice((0.5, 1.0, 2.0)),) * n
            else:
                compute = tuple(rng.uniform(1e-3, 1e-2) for _ in range(n))
                load = tuple(rng.uniform(1e-4, 2e-3) for _ in range(n))
            stages.append(StagePlan(
                n_layers=1 if mode == "token" else n,
                compute_s=compute,
                fixed_s=(0.0,) * n,
                load_s=load,
                load_channel=tuple(rng.choice((NOT_STORED, *range(n_channels))) if rng.random() < 0.1
                                   else (i + u) % n_channels for u in range(n)),
                tokens=tuple(rng.choice((256, 256, 256, 100)) for _ in range(n)),
            ))
        arrival = float(i) if costs == "exact" else rng.uniform(0, n_requests)
        plans.append(RequestPlan(request_id=f"r{i}", arrival_s=arrival, mode=mode, n_tokens=n_chunks,
                                 stages=tuple(stages)))
    return plans


class Lockstep:
    """Drives the product's scheduler and the oracle with the same calls, checking they answer alike."""

    def __init__(self, policy: str, n_stages: int, n_channels: int, plans: list[RequestPlan], rng: random.Random,
                 *, costs: str, mixed: bool) -> None:
        self.new = BatchScheduler(policy, n_stages=n_stages)
        self.old = OracleScheduler(policy, n_stages=n_stages)
        self.n_stages = n_stages
        self.n_channels = n_channels
        self.to_arrive = deque(plans)
        self.rng = rng
        self.exact = costs == "exact"
        self.mixed = mixed
        self.now = 0.0
        self.batches: dict[int, list[ComputeTask]] = {}
        self.loads: list[LoadTask] = []
        self.held_back: set[tuple[str, int]] = set()  # units the `ready` predicate holds back for now
        self.decisions = 0
        # how many channels and stages may be lost and requests cancelled, at random moments
        self.losses = {"channel_lost": rng.choice((0, 0, 1)), "stage_lost": rng.choice((0, 0, 0, 1)),
                       "cancel": rng.choice((0, 1, 2))}

    def both(self, name: str, *args: Any, **kwargs: Any) -> Any:
        answer = getattr(self.new, name)(*args, **kwargs)
        expected = getattr(self.old, name)(*args, **kwargs)
        assert answer == expected, f"{name}{args} at decision {self.decisions}: {answer} != oracle's {expected}"
        return answer

    def ready(self, request_id: str, unit: int) -> bool:
        return (request_id, unit) not in self.held_back

    def tick(self) -> None:
        self.now += self.rng.choice((0.25, 0.5, 1.0)) if self.exact else self.rng.uniform(0, 5e-3)

    def random_step(self) -> bool:
        """One random action; False if it did nothing."""
        rng = self.rng
        r = rng.random()
        if r < 0.08 and self.to_arrive:
            plan = self.to_arrive.popleft()
            policy = POLICIES[rng.choice(sorted(POLICIES))] if self.mixed else None
            self.old.arrive(plan, policy)
            work = self.new.arrive(plan, policy)  # its record: the states the oracle's unit_states would list
            assert work.request_id == plan.request_id and len(work.stages) == self.n_stages
            return True
        if r < 0.35:
            return self.start_batch(rng.randrange(self.n_stages))
        if r < 0.5 and self.batches:
            self.finish_batch(rng.choice(sorted(self.batches)))
            return True
        if r < 0.7:
            return self.start_load(rng.randrange(self.n_channels))
        if r < 0.9 and self.loads:
            self.finish_load(rng.randrange(len(self.loads)))
            return True
        if r < 0.95:
            self.tick()
            active = self.new.active()
            self.held_back = {(rng.choice(active), rng.randrange(12)) for _ in range(3)} if active else set()
            return False
        if r < 0.96:
            return self.lose("channel_lost", rng.randrange(self.n_channels))
        if r < 0.97:
            return self.lose("stage_lost", rng.randrange(self.n_stages))
        if r < 0.98 and self.new.active():
            return self.lose("cancel", rng.choice(self.new.active()))
        return False

    def lose(self, event: str, what: int | str) -> bool:
        """A channel or stage lost, or a request cancelled, while the budget for it lasts."""
        if not self.losses[event]:
            return False
        self.losses[event] -= 1
        self.both(event, what)
        return True

    def start_batch(self, stage: int) -> bool:
        if stage in self.batches:
            return False
        max_tokens = self.rng.choice((None, 256, 300, 512, 1024))
        self.decisions += 1
        batch = self.both("next_compute_batch", stage, max_tokens, now=self.now, ready=self.ready)
        if batch:
            self.batches[stage] = batch
        return bool(batch)

    def finish_batch(self, stage: int) -> None:
        batch = self.batches.pop(stage)
        self.tick()
        self.both("step_done", stage, float(len(batch)) if self.exact else self.rng.uniform(1e-2, 1e-1))
        for task in batch:
            self.both("computed", stage, task.request_id, task.unit)

    def start_load(self, channel: int) -> bool:
        self.decisions += 1
        task = self.both("next_load", channel, self.now)
        if task is not None:
            self.loads.append(task)
        return task is not None

    def finish_load(self, index: int) -> None:
        task = self.loads.pop(index)
        self.tick()
        if self.rng.random() < 0.1:
            self.both("load_missed", task.stage, task.request_id, task.unit, "absent")
        else:  # exact costs: no clock for the calibration (its scale would not be a power of two)
            self.both("loaded", task.stage, task.request_id, task.unit, None if self.exact else self.now)

    def quiescent(self) -> bool:
        """Nothing left to arrive or in flight, and no stage or channel gets anything."""
        if self.to_arrive or self.batches or self.loads:
            return False
        self.held_back = set()
        started = [self.start_batch(stage) for stage in range(self.n_stages)]
        started += [self.start_load(channel) for channel in range(self.n_channels)]
        return not any(started)

    def run(self, max_steps: int = 50_000) -> None:
        for _ in range(max_steps):
            if not self.random_step() and self.quiescent():
                break
        else:
            raise AssertionError("the driver never came to rest")
        assert self.new.finished() == self.old.finished() and self.new.failed() == self.old.failed()
        assert self.new.active() == self.old.active() == []
