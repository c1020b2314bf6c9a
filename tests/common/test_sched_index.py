"""The scheduler's incremental state equals a from-scratch recount after any random sequence of decisions
and events: every request's PENDING units and exact load per channel, its stages' pointers' span, and the
batch index's orders, totals and answers (`cacheflow_common.sched.index`)."""

from __future__ import annotations

import random
from collections import Counter
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from cacheflow_common.restore.pointers import Unit
from cacheflow_common.sched import POLICIES, BatchScheduler, rank_order
from cacheflow_common.sched.exact import exact
from cacheflow_common.sched.index import BatchIndex
from cacheflow_common.sched.work import RequestWork, StageWork
from tests.common.sched_lockstep import COSTS, Lockstep, random_plans


def _check_stage(work: StageWork, rng: random.Random) -> tuple[Counter[int], Counter[int]]:
    """The stage's own answers against its unit states; returns its PENDING units and load per channel."""
    plan, states = work.plan, work.pointers.states
    pending = [u for u, state in enumerate(states) if state is Unit.PENDING]
    whole = range(pending[0], pending[-1] + 1) if pending else None
    assert work.whole_pending_span() == (whole if whole is not None and len(whole) == len(pending) else None)
    assert sorted(work.pending_channels()) == sorted({plan.load_channel[u] for u in pending})
    start = rng.randrange(plan.n_units + 1)
    end = rng.randrange(start, plan.n_units + 1)
    for channel in work.pending_channels():
        held = [u for u in range(start, end) if plan.load_channel[u] == channel]
        assert work.load_between(channel, start, end) == sum(exact(plan.load_s[u]) for u in held)
    return (Counter(plan.load_channel[u] for u in pending),
            Counter({c: sum(exact(plan.load_s[u]) for u in pending if plan.load_channel[u] == c)
                     for c in {plan.load_channel[u] for u in pending}}))


def _check_request(request: RequestWork, rng: random.Random) -> None:
    units: Counter[int] = Counter()
    load: Counter[int] = Counter()
    for work in request.stages:
        stage_units, stage_load = _check_stage(work, rng)
        units.update(stage_units)
        load.update(stage_load)
    assert +request.pending_on == units and +request.pending_load == load


def _check_index(batch: BatchIndex, active: list[RequestWork], now: float, channels: range) -> None:
    loading = [r for r in active if r.policy.loads]
    by_request = sorted((r.policy.load_rank(r, now), r.order, r) for r in loading if not r.policy.ranks_units)
    for rank, _, request in by_request:
        assert batch.ranks.filed(request) == (rank, {c: request.pending_load[c] for c in request.pending_on
                                                     if request.pending_on[c] > 0})
    for channel in channels:
        holders = [(rank, r, r.pending_load[channel]) for rank, _, r in by_request if r.pending_on[channel] > 0]
        order = batch.ranks.orders().get(channel)
        assert (list(order.entries()) if order else []) == holders
        assert all(kept == summed for kept, summed in (order.block_totals() if order else []))
        assert batch.ranks.top(channel) is (holders[-1][1] if holders else None)
        for request in loading:
            rank = request.policy.load_rank(request, now)
            above = sum(r.pending_load[channel] for r in loading
                        if r.pending_on[channel] > 0 and r.policy.load_rank(r, now) > rank)
            assert batch.load_above(rank, channel) == above
    few = [r for r in active if r.policy.advances_few]
    assert list(batch.fewest_first()) == sorted(few, key=lambda r: (r.remaining_s, r.order))
    assert list(batch.few_by_arrival()) == few
    assert list(batch.every_by_arrival()) == [r for r in active if not r.policy.advances_few]
    assert list(batch.unit_ranked) == [r for r in loading if r.policy.ranks_units]
    assert batch.smallest_unit() == min((r.smallest_unit for r in active), default=0)


def _check(scheduler: BatchScheduler, now: float, n_channels: int, rng: random.Random) -> None:
    active = list(scheduler._active.values())
    for request in active:
        _check_request(request, rng)
    scheduler._index.sync(now)
    _check_index(scheduler._index, active, now, range(n_channels))


@settings(max_examples=80, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    mixed=st.booleans(),
    costs=st.sampled_from(COSTS),
    n_requests=st.integers(1, 80),
    n_stages=st.integers(1, 3),
    n_channels=st.integers(1, 3),
    block=st.sampled_from((1, 2, rank_order.BLOCK)),  # small blocks: a rank order of a few requests spans many
    seed=st.integers(0, 2**32 - 1),
)
def test_incremental_state_equals_a_recount_after_random_events(policy, mixed, costs, n_requests, n_stages,
                                                                 n_channels, block, seed):
    rng = random.Random(seed)
    plans = random_plans(rng, n_requests, n_stages, n_channels, costs)
    with mock.patch.object(rank_order, "BLOCK", block):
        driver = Lockstep(policy, n_stages, n_channels, plans, rng, costs=costs, mixed=mixed)
        for step in range(100_000):
            if not driver.random_step() and driver.quiescent():
                break
            if step % 7 == 0:
                _check(driver.new, driver.now, n_channels, rng)
        _check(driver.new, driver.now, n_channels, rng)
    assert not driver.new.active()
