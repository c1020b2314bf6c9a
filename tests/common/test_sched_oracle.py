"""The incremental scheduler decides exactly as the straightforward one did (`tests/common/sched_oracle`):
random workloads for every registered policy, and batches mixing policies, played against both at once
(`sched_lockstep`), compared decision by decision and event by event."""

from __future__ import annotations

import random
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from cacheflow_common.sched import POLICIES, rank_order
from tests.common.sched_lockstep import COSTS, Lockstep, random_plans


@settings(max_examples=120, deadline=None)
@given(
    policy=st.sampled_from(sorted(POLICIES)),
    costs=st.sampled_from(COSTS),
    n_requests=st.integers(1, 10),
    n_stages=st.integers(1, 3),
    n_channels=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_policy_decides_as_the_oracle(policy, costs, n_requests, n_stages, n_channels, seed):
    rng = random.Random(seed)
    plans = random_plans(rng, n_requests, n_stages, n_channels, costs)
    Lockstep(policy, n_stages, n_channels, plans, rng, costs=costs, mixed=False).run()


@settings(max_examples=60, deadline=None)
@given(costs=st.sampled_from(COSTS), n_requests=st.integers(2, 12), n_channels=st.integers(1, 3),
       seed=st.integers(0, 2**32 - 1))
def test_batches_mixing_policies_decide_as_the_oracle(costs, n_requests, n_channels, seed):
    rng = random.Random(seed)
    plans = random_plans(rng, n_requests, 2, n_channels, costs)
    Lockstep("cacheflow", 2, n_channels, plans, rng, costs=costs, mixed=True).run()


def test_long_batches_decide_as_the_oracle():
    """150 requests, their rank order in blocks of 2 and of the default size, for the three policies the
    benchmarks time."""
    for policy in ("cacheflow", "cacheflow-srpt", "cake"):
        for costs in COSTS:
            for block in (2, rank_order.BLOCK):
                rng = random.Random(f"{policy}/{costs}")
                plans = random_plans(rng, 150, 1, 2, costs)
                with mock.patch.object(rank_order, "BLOCK", block):
                    Lockstep(policy, 1, 2, plans, rng, costs=costs, mixed=False).run(max_steps=200_000)
