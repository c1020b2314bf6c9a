"""Properties of the batch scheduler under random plans and random interleavings of decisions and events.

A driver plays the workers and storage: it asks for compute batches and loads, keeps them in flight,
and reports them done (or missed) in a random order, with arrivals, lost channels and lost stages mixed
in. Checked throughout: no unit is claimed while in flight, the pointers never cross; at the end:
every unit restored exactly once (token mode; layer mode may recompute loaded layers below a miss),
every request finished or failed for a lost stage, and nothing hangs.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque

from hypothesis import given, settings
from hypothesis import strategies as st

from cacheflow_common.restore.pointers import Unit
from cacheflow_common.sched import NOT_STORED, POLICIES, BatchScheduler, RequestPlan, StagePlan
from cacheflow_common.sched.scheduler import ComputeTask, LoadTask

Key = tuple[str, int, int]  # request, stage, unit


def _random_plans(rng: random.Random, n_requests: int, n_stages: int, n_channels: int) -> list[RequestPlan]:
    plans = []
    for i in range(n_requests):
        mode = rng.choice(("token", "layer"))
        n_chunks = rng.randint(1, 20)
        stages = []
        for _ in range(n_stages):
            n = n_chunks if mode == "token" else rng.randint(1, 20)
            stages.append(StagePlan(
                n_layers=1 if mode == "token" else n,
                compute_s=tuple(rng.uniform(0.1, 10) for _ in range(n)),
                fixed_s=(0.0,) * n,
                load_s=(1.0,) * n,
                load_channel=tuple(rng.randint(NOT_STORED, n_channels - 1) for _ in range(n)),
                tokens=(rng.randint(1, 512),) * n,
            ))
        plans.append(RequestPlan(request_id=f"r{i}", arrival_s=float(i), mode=mode, n_tokens=n_chunks,
                                 stages=tuple(stages)))
    return plans


class Driver:
    """Plays the stages and the storage channels around one scheduler, at random."""

    def __init__(self, scheduler: BatchScheduler, plans: list[RequestPlan], rng: random.Random, *,
                 n_channels: int, miss_rate: float, channel_losses: int, stage_losses: int) -> None:
        self.s = scheduler
        self.plans = {p.request_id: p for p in plans}
        self.to_arrive = deque(plans)
        self.rng = rng
        self.n_channels = n_channels
        self.miss_rate = miss_rate
        self.channel_losses = channel_losses
        self.stage_losses = stage_losses
        self.batches: dict[int, list[ComputeTask]] = {}  # stage -> batch in flight
        self.loads: list[tuple[int, LoadTask]] = []  # (channel, load) in flight
        self.abandoned: list[LoadTask] = []  # in flight when their channel was lost: their reports are stale
        self.sources: defaultdict[Key, list[str]] = defaultdict(list)  # how each unit was restored, in order
        self.missed: set[Key] = set()
        self.lost_channels: set[int] = set()
        self.lost_stages: set[int] = set()

    # -- actions -------------------------------------------------------------------------------
    def start_batch(self, stage: int) -> bool:
        if stage in self.batches or stage in self.lost_stages:
            return False
        batch = self.s.next_compute_batch(stage, max_tokens=self.rng.choice((None, 256, 1024)))
        assert len({t.request_id for t in batch}) == len(batch), "two units of one request in one batch"
        for task in batch:
            key = (task.request_id, stage, task.unit)
            assert not self._in_flight(key), f"{key} claimed while in flight"
            plan = self.plans[task.request_id]
            if plan.mode == "token":
                assert not self.sources[key], f"{key} computed after it was restored"
            self._check_states(task.request_id, stage)
        if batch:
            self.batches[stage] = batch
        return bool(batch)

    def finish_batch(self, stage: int) -> None:
        for task in self.batches.pop(stage):
            if self.s.computed(stage, task.request_id, task.unit):
                self.sources[(task.request_id, stage, task.unit)].append("computed")

    def start_load(self, channel: int) -> bool:
        task = self.s.next_load(channel)
        if task is None:
            return False
        key = (task.request_id, task.stage, task.unit)
        assert channel not in self.lost_channels
        assert self.plans[task.request_id].stages[task.stage].load_channel[task.unit] == channel
        assert not self._in_flight(key) and not self.sources[key], f"{key} loaded twice"
        self.loads.append((channel, task))
        self._check_states(task.request_id, task.stage)
        return True

    def finish_load(self, index: int) -> None:
        _, task = self.loads.pop(index)
        key = (task.request_id, task.stage, task.unit)
        if self.rng.random() < self.miss_rate:
            if self.s.load_missed(task.stage, task.request_id, task.unit, "absent"):
                self.missed.add(key)
        elif self.s.loaded(task.stage, task.request_id, task.unit):
            self.sources[key].append("loaded")

    def lose_channel(self, channel: int) -> None:
        self.channel_losses -= 1
        self.lost_channels.add(channel)
        self.abandoned += [task for ch, task in self.loads if ch == channel]
        self.loads = [(ch, task) for ch, task in self.loads if ch != channel]
        self.s.channel_lost(channel)

    def random_step(self) -> bool:
        """One random action; False if it did nothing."""
        r = self.rng.random()
        if r < 0.1 and self.to_arrive:
            self.s.arrive(self.to_arrive.popleft())
            return True
        if r < 0.4:
            return self.start_batch(self.rng.randrange(self.s.n_stages))
        if r < 0.55 and self.batches:
            self.finish_batch(self.rng.choice(sorted(self.batches)))
            return True
        if r < 0.75:
            return self.start_load(self.rng.randrange(self.n_channels))
        if r < 0.95 and self.loads:
            self.finish_load(self.rng.randrange(len(self.loads)))
            return True
        if r < 0.96 and self.abandoned:
            task = self.abandoned.pop()
            assert not self.s.loaded(task.stage, task.request_id, task.unit), "a stale load was applied"
            return True
        if r < 0.97 and self.channel_losses:
            self.lose_channel(self.rng.randrange(self.n_channels))
            return True
        if r < 0.975 and self.stage_losses:
            self.stage_losses -= 1
            stage = self.rng.randrange(self.s.n_stages)
            self.lost_stages.add(stage)
            self.s.stage_lost(stage)
            return True
        return False

    def quiescent(self) -> bool:
        """Nothing left to arrive or in flight, and no stage or channel gets anything: done (or hung)."""
        if self.to_arrive or self.batches or self.loads:
            return False
        started = [self.start_batch(stage) for stage in range(self.s.n_stages)]
        started += [self.start_load(channel) for channel in range(self.n_channels)]
        return not any(started)

    # -- checks --------------------------------------------------------------------------------
    def _in_flight(self, key: Key) -> bool:
        rid, stage, unit = key
        in_batch = any(t.request_id == rid and t.unit == unit for t in self.batches.get(stage, []))
        return in_batch or any(t == LoadTask(rid, stage, unit) for _, t in self.loads)

    def _check_states(self, rid: str, stage: int) -> None:
        """The scheduler's view matches what is in flight: a unit is computing or loading, never both."""
        states = self.s.unit_states(rid, stage)
        computing = {t.unit for t in self.batches.get(stage, []) if t.request_id == rid}
        loading = {t.unit for _, t in self.loads if t.request_id == rid and t.stage == stage}
        assert not computing & loading
        assert {u for u, st in enumerate(states) if st is Unit.LOADING} <= loading
        assert len([st for st in states if st is Unit.COMPUTING]) <= 1

    def check_final(self) -> None:
        failed = self.s.failed()
        assert self.s.active() == [], "requests hung"
        assert set(self.s.finished()) | set(failed) == set(self.plans)
        for reason in failed.values():
            assert self.lost_stages and reason.startswith("stage "), reason
        for rid in self.s.finished():
            self._check_restored_once(self.plans[rid])

    def _check_restored_once(self, plan: RequestPlan) -> None:
        for stage, sp in enumerate(plan.stages):
            sources = [self.sources[(plan.request_id, stage, u)] for u in range(sp.n_units)]
            assert all(sources), "a unit was never restored"
            if plan.mode == "token":
                assert all(len(s) == 1 for s in sources), sources
            else:  # compute walks up from layer 0; it passes loaded layers only below one it must compute
                computed = [u for u, s in enumerate(sources) if "computed" in s]
                assert computed == list(range(len(computed)))
                assert all(s in (["computed"], ["loaded"], ["loaded", "computed"]) for s in sources), sources
                if computed:
                    assert "loaded" not in sources[computed[-1]]
            for u in range(sp.n_units):
                key = (plan.request_id, stage, u)
                if key in self.missed or sp.load_channel[u] == NOT_STORED:
                    assert sources[u][-1] == "computed"


@settings(max_examples=150, deadline=None)
@given(
    n_requests=st.integers(1, 6),
    n_stages=st.integers(1, 4),
    n_channels=st.integers(1, 3),
    policy=st.sampled_from(sorted(POLICIES)),
    miss_rate=st.sampled_from([0.0, 0.2, 0.6]),
    channel_losses=st.integers(0, 2),
    stage_losses=st.sampled_from([0, 0, 1]),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_unit_restored_once_and_every_request_ends(n_requests, n_stages, n_channels, policy, miss_rate,
                                                        channel_losses, stage_losses, seed):
    rng = random.Random(seed)
    plans = _random_plans(rng, n_requests, n_stages, n_channels)
    driver = Driver(BatchScheduler(policy, n_stages=n_stages), plans, rng, n_channels=n_channels,
                    miss_rate=miss_rate, channel_losses=channel_losses, stage_losses=stage_losses)
    for _ in range(100_000):
        if not driver.random_step() and driver.quiescent():
            break
    else:
        raise AssertionError("the driver never came to rest")
    driver.check_final()


def _stream_plan(rid: str, n_units: int, cost: float, arrival: float) -> RequestPlan:
    sp = StagePlan(n_layers=1, compute_s=(cost,) * n_units, fixed_s=(0.0,) * n_units, load_s=(1.0,) * n_units,
                   load_channel=(0,) * n_units, tokens=(256,) * n_units)
    return RequestPlan(request_id=rid, arrival_s=arrival, mode="token", n_tokens=256 * n_units, stages=(sp, sp))


@given(max_tokens=st.sampled_from([None, 256, 1024]), policy=st.sampled_from(sorted(POLICIES)))
def test_a_short_request_finishes_under_a_stream_of_longer_ones(max_tokens, policy):
    s = BatchScheduler(policy, n_stages=2)
    s.arrive(_stream_plan("short", 3, 1.0, arrival=0.0))
    for step in range(1, 100):
        s.arrive(_stream_plan(f"long{step}", 10 + step, 5.0, arrival=float(step)))  # always a longer one
        load = s.next_load(0)
        batches = [(stage, s.next_compute_batch(stage, max_tokens)) for stage in range(2)]
        if load is not None:
            s.loaded(load.stage, load.request_id, load.unit)
        for stage, batch in batches:
            for task in batch:
                s.computed(stage, task.request_id, task.unit)
        if "short" in s.finished():
            assert step <= 6  # never more steps than its own units (3 on each of 2 stages; load-only: one channel)
            return
    raise AssertionError("the short request starved")
