"""The batch scheduler: the priority rule by example, plans from the cost model, and properties under
random interleavings of decisions and events (misses, lost channels, lost stages)."""

from __future__ import annotations

import re

import pytest

from cacheflow_common.errors import BadRequestError, ConfigError
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.restore.pointers import InvalidTransitionError, Unit
from cacheflow_common.sched import (
    NOT_STORED,
    BatchScheduler,
    RequestPlan,
    StagePlan,
    build_plan,
    choose_mode,
    make_policy,
    policies,
)
from cacheflow_common.sched.policies import POLICIES
from cacheflow_common.sched.scheduler import ComputeTask, LoadTask

COSTS = CostModel(chunk_compute=LinearCost(fixed_s=1e-3, per_token_s=1e-5, per_token_ctx_s=1e-8),
                  layer_compute=LinearCost(fixed_s=2e-3, per_token_s=1e-5, per_token_ctx_s=1e-8),
                  load=LoadCost(bytes_per_s=1e9, latency_s=1e-4))


def stage(compute: list[float], channels: list[int] | None = None, *, load: float = 1.0, tokens: int = 1) -> StagePlan:
    n = len(compute)
    return StagePlan(n_layers=1, compute_s=tuple(compute), fixed_s=(0.0,) * n, load_s=(load,) * n,
                     load_channel=tuple(channels if channels is not None else [0] * n), tokens=(tokens,) * n)


def plan(rid: str, *stages: StagePlan, arrival: float = 0.0, mode: str = "token") -> RequestPlan:
    n_tokens = sum(stages[0].tokens) if mode == "token" else stages[0].tokens[0] if stages[0].tokens else 0
    return RequestPlan(request_id=rid, arrival_s=arrival, mode=mode, n_tokens=n_tokens, stages=stages)


def scheduler(policy: str, *plans: RequestPlan) -> BatchScheduler:
    s = BatchScheduler(policy, n_stages=len(plans[0].stages))
    for p in plans:
        s.arrive(p)
    return s


# -- the priority rule ------------------------------------------------------------------------------
def test_algorithm_1_serves_the_largest_remaining_recomputation_cost_cake_the_oldest():
    short = plan("short", stage([1.0, 1.0, 1.0]), arrival=0.0)
    long = plan("long", stage([1.0, 2.0, 3.0, 4.0, 5.0]), arrival=1.0)
    assert scheduler("cacheflow-alg1", short, long).next_load(0) == LoadTask("long", 0, 4)
    assert scheduler("cake", short, long).next_load(0) == LoadTask("short", 0, 2)
    assert scheduler("load-only", short, long).next_load(0) == LoadTask("short", 0, 2)
    assert scheduler("compute-only", short, long).next_load(0) is None


def test_the_studied_rankings_serve_the_least_remaining_cost_or_the_largest_share_done():
    short = plan("short", stage([1.0, 1.0, 1.0]), arrival=1.0)
    long = plan("long", stage([1.0, 2.0, 3.0, 4.0, 5.0]), arrival=0.0)
    assert scheduler("cacheflow-srpt", short, long).next_load(0) == LoadTask("short", 0, 2)
    s = scheduler("cacheflow-progress", short, long)
    assert s.next_compute_batch(0) == [ComputeTask("short", 0), ComputeTask("long", 0)]
    assert s.next_load(0) == LoadTask("short", 0, 2)  # 1/3 of its work claimed vs 1/15 of long's
    assert s.next_load(0) == LoadTask("short", 0, 1)  # 2/3; it stays ahead of long until it is done


def test_the_response_ratio_ranking_serves_short_work_first_unless_long_work_has_waited_longer():
    short = plan("short", stage([1.0, 1.0, 1.0]), arrival=1.0)  # remaining 3
    long = plan("long", stage([1.0, 2.0, 3.0, 4.0, 5.0]), arrival=0.0)  # remaining 15
    assert scheduler("cacheflow-hrrn", short, long).next_load(0, now=10.0) == LoadTask("short", 0, 2)  # 12/3 > 25/15
    assert scheduler("cacheflow-hrrn", short, long).next_load(0, now=1.0) == LoadTask("long", 0, 4)  # 3/3 < 16/15


def test_priority_is_re_evaluated_at_every_decision():
    a = plan("a", stage([5.0, 5.0]))  # remaining 10
    b = plan("b", stage([3.0, 3.0, 3.0]), arrival=1.0)  # remaining 9
    s = scheduler("cacheflow-alg1", a, b)
    assert s.next_load(0) == LoadTask("a", 0, 1)  # a drops to 5 (a unit in flight is no longer open work)
    assert s.remaining_s("a") == 5.0
    assert s.next_load(0) == LoadTask("b", 0, 2)  # b (9) now leads; then b has 6
    assert s.next_load(0) == LoadTask("b", 0, 1)  # b (6) still leads a (5)
    assert s.next_load(0) == LoadTask("a", 0, 0)


def test_a_miss_puts_the_work_back_into_the_remaining_cost():
    s = scheduler("cacheflow-alg1", plan("a", stage([5.0, 5.0])))
    task = s.next_load(0)
    assert task is not None and s.remaining_s("a") == 5.0
    assert s.load_missed(task.stage, task.request_id, task.unit, "absent")
    assert s.remaining_s("a") == 10.0 and s.misses["absent"] == 1


def test_each_channel_takes_its_highest_pending_unit():
    s = scheduler("cacheflow", plan("a", stage([1.0] * 5, [0, 1, 0, 1, NOT_STORED])))
    assert s.next_load(0) == LoadTask("a", 0, 2)
    assert s.next_load(1) == LoadTask("a", 0, 3)
    assert s.next_load(0) == LoadTask("a", 0, 0)
    assert s.next_load(1) == LoadTask("a", 0, 1)
    assert s.next_load(0) is None
    assert s.unit_states("a", 0)[4] is Unit.MISSED  # not stored: compute work from the start


def test_a_channel_serves_the_stage_with_the_most_open_work():
    s = scheduler("cacheflow", plan("a", stage([1.0, 1.0]), stage([3.0, 3.0]), stage([2.0, 2.0])))
    assert s.next_load(0) == LoadTask("a", 1, 1)
    assert s.next_load(0) == LoadTask("a", 2, 1)  # stage 1 has 3 left, stage 2 has 4


def test_compute_batch_advances_every_active_request_oldest_first():
    a = plan("a", stage([1.0] * 3, tokens=100))
    b = plan("b", stage([1.0] * 3, tokens=100), arrival=1.0)
    c = plan("c", stage([1.0] * 3, tokens=100), arrival=2.0)
    s = scheduler("cake", a, b, c)
    assert s.next_compute_batch(0) == [ComputeTask("a", 0), ComputeTask("b", 0), ComputeTask("c", 0)]
    assert s.next_compute_batch(0) == []  # each request's unit 0 is still computing
    for rid in "abc":
        s.computed(0, rid, 0)
    assert s.next_compute_batch(0, max_tokens=150) == [ComputeTask("a", 1)]
    assert s.next_compute_batch(0, max_tokens=50) == [ComputeTask("b", 1)]  # the oldest one always fits


def test_load_only_computes_only_what_storage_cannot_deliver():
    s = scheduler("load-only", plan("a", stage([1.0] * 3, [0, NOT_STORED, 0])))
    assert s.next_compute_batch(0) == []
    assert s.next_load(0) == LoadTask("a", 0, 2)
    assert s.next_load(0) == LoadTask("a", 0, 0)
    s.loaded(0, "a", 0)
    assert s.next_compute_batch(0) == [ComputeTask("a", 1)]  # the unstored unit, once unit 0 is in
    s.computed(0, "a", 1)
    s.loaded(0, "a", 2)
    assert s.finished() == ["a"] and s.active() == []


def test_a_lost_channel_turns_pending_and_in_flight_loads_into_compute_work():
    s = scheduler("load-only", plan("a", stage([1.0] * 4, [0, 1, 0, 1])))
    assert s.next_load(1) == LoadTask("a", 0, 3)
    s.channel_lost(1)
    assert s.next_load(1) is None
    assert not s.loaded(0, "a", 3)  # stale: that load's channel is gone
    assert s.unit_states("a", 0) == [Unit.PENDING, Unit.MISSED, Unit.PENDING, Unit.MISSED]
    s2 = scheduler("load-only", plan("b", stage([1.0] * 2, [1, 1])))
    s2.channel_lost(1)
    s2.arrive(plan("c", stage([1.0], [1])))  # arriving after the loss: its units are compute work
    assert s2.unit_states("c", 0) == [Unit.MISSED]


def test_a_lost_stage_fails_its_requests_instead_of_hanging():
    s = scheduler("cacheflow", plan("a", stage([1.0] * 2), stage([1.0] * 2)))
    batch = s.next_compute_batch(1)
    s.stage_lost(0)
    assert s.failed() == {"a": "stage 0 lost"} and s.active() == []
    assert not s.computed(1, "a", batch[0].unit)  # stale
    assert s.next_compute_batch(0) == [] and s.next_load(0) is None
    s.arrive(plan("b", stage([1.0]), stage([1.0])))
    assert s.failed()["b"] == "stage 0 lost"


def test_protocol_violations_are_errors_not_silently_ignored():
    s = scheduler("cacheflow", plan("a", stage([1.0] * 2)))
    with pytest.raises(InvalidTransitionError):
        s.computed(0, "a", 0)  # never claimed
    with pytest.raises(InvalidTransitionError):
        s.computed(0, "nobody", 0)
    with pytest.raises(BadRequestError):
        s.arrive(plan("a", stage([1.0])))
    with pytest.raises(BadRequestError):
        s.arrive(plan("b", stage([1.0]), stage([1.0])))  # wrong number of stages
    with pytest.raises(ConfigError):
        make_policy("fastest")


def test_an_empty_prefix_is_finished_on_arrival():
    s = scheduler("cacheflow", plan("a", stage([]), stage([])))
    assert s.finished() == ["a"]


# -- the policies as their module describes them -------------------------------------------------------
TABLE_MODES = {"token": "token", "layer": "layer", "N >= L_delta": "adaptive"}
TABLE_COMPUTE = {"every request": "every-request", "shortest and oldest": "shortest-and-oldest",
                 "as `cacheflow`": "shortest-and-oldest"}
TABLE_RANKINGS = {"the oldest": "arrival", "nobody": "arrival", "as `cacheflow`": "arrival",
                  "least remaining": "least-remaining", "most remaining": "most-remaining",
                  "largest share": "most-done", "highest response ratio": "response-ratio",
                  "most compute saved": "saving"}


def test_the_policy_table_of_the_policies_module_says_what_each_policy_does():
    rows = re.findall(r"^\| `([a-z0-9-]+)` +\|(.+?)\|(.+?)\|(.+?)\|(.+?)\|$", policies.__doc__ or "", re.M)
    assert sorted(name for name, *_ in rows) == sorted(POLICIES)
    for name, mode, _, compute, channels in rows:
        policy = POLICIES[name]
        assert TABLE_MODES[mode.strip()] == policy.mode, name
        assert TABLE_COMPUTE[compute.strip()] == policy.compute, name
        (ranking,) = {r for words, r in TABLE_RANKINGS.items() if channels.strip().startswith(words)}
        assert ranking == policy.ranking, name


# -- plans from the cost model -------------------------------------------------------------------------
def _build(n_tokens: int, l_delta: int) -> RequestPlan:
    mode = choose_mode(make_policy("cacheflow"), n_tokens, l_delta, pipeline=False)
    return build_plan(request_id="r", arrival_s=0.0, n_tokens=n_tokens, costs=COSTS, stage_layers=[3, 2],
                      chunk_size=256, mode=mode, kv_bytes_per_token_layer=100,
                      place=lambda s, u: NOT_STORED if (s, u) == (1, 0) else (s + u) % 2)


def test_token_wise_plan_has_one_unit_per_chunk_with_the_cost_models_prices():
    p = _build(600, l_delta=512)
    assert p.mode == "token" and [st.n_units for st in p.stages] == [3, 3]
    first = p.stages[0]
    assert first.tokens == (256, 256, 88)
    assert first.compute_s[2] == COSTS.chunk_compute_s(512, 600, 3)
    assert first.fixed_s[0] == 3 * COSTS.chunk_compute.fixed_s
    assert first.load_s[1] == COSTS.chunk_load_s(256 * 3 * 100)
    assert first.load_channel == (0, 1, 0) and p.stages[1].load_channel == (NOT_STORED, 0, 1)
    assert sum(p.unit_tokens(s, u) for s in range(2) for u in range(3)) == pytest.approx(600)


def test_layer_wise_plan_below_l_delta_has_one_unit_per_layer():
    p = _build(300, l_delta=512)
    assert p.mode == "layer" and [st.n_units for st in p.stages] == [3, 2]
    assert p.stages[1].compute_s == (COSTS.layer_compute_s(300),) * 2
    assert p.stages[0].load_s[0] == COSTS.layer_load_s(300 * 100, 2)
    assert p.stages[0].tokens == (300, 300, 300)
    assert sum(p.unit_tokens(s, u) for s in range(2) for u in range(p.stages[s].n_units)) == pytest.approx(300)


# -- the batch-level meeting point ------------------------------------------------------------------
def _loading(policy: str, *, load: float, step: float) -> BatchScheduler:
    """One request of 6 unit-cost chunks on channel 0, its top unit loading since t=0 (predicted `load` s),
    and a compute loop whose steps take `step` s."""
    s = scheduler(policy, plan("a", stage([1.0] * 6, load=load)))
    s.step_done(0, step)
    assert s.next_load(0, now=0.0) == LoadTask("a", 0, 5)
    return s


def test_a_planned_request_leaves_a_unit_to_the_channel_that_would_load_it_sooner():
    # Loads take 0.1 s and steps 1 s: the channel loads units 4..0 in 0.5 s, before one step ends.
    assert _loading("cacheflow", load=0.1, step=1.0).next_compute_batch(0, now=0.0) == []
    # The same request under Cake computes from the front wherever the loader is.
    assert _loading("cake", load=0.1, step=1.0).next_compute_batch(0, now=0.0) == [ComputeTask("a", 0)]


def test_a_planned_request_computes_when_the_loop_is_faster_than_its_channel():
    # Steps take 0.1 s and loads 1 s: compute should take the front units, the channel the back.
    assert _loading("cacheflow", load=1.0, step=0.1).next_compute_batch(0, now=0.0) == [ComputeTask("a", 0)]


def test_the_step_time_the_batch_makes_moves_the_meeting_point():
    # Loads take 0.3 s. A lone request's 0.1 s steps beat the channel to the front; once the batch
    # makes every step take 2 s, the channel gets there first.
    assert _loading("cacheflow", load=0.3, step=0.1).next_compute_batch(0, now=0.0) == [ComputeTask("a", 0)]
    assert _loading("cacheflow", load=0.3, step=2.0).next_compute_batch(0, now=0.0) == []


def test_a_request_with_no_load_in_flight_always_computes():
    s = scheduler("cacheflow", plan("a", stage([1.0] * 6, load=0.01)))
    s.step_done(0, 10.0)
    assert s.next_compute_batch(0, now=0.0) == [ComputeTask("a", 0)]


def test_measured_loads_recalibrate_the_predictions():
    s = _loading("cacheflow", load=0.1, step=1.0)
    assert s.loaded(0, "a", 5, now=5.0)  # predicted 0.1 s, took 5 s: loads are far slower than planned
    assert s.next_load(0, now=5.0) == LoadTask("a", 0, 4)
    assert s.next_compute_batch(0, now=5.0) == [ComputeTask("a", 0)]


def test_requests_carry_their_own_policy():
    s = BatchScheduler("cacheflow", n_stages=1)
    s.arrive(plan("vllm", stage([1.0] * 3)), make_policy("compute-only"))
    s.arrive(plan("cf", stage([1.0] * 3), arrival=1.0))
    assert s.next_load(0) == LoadTask("cf", 0, 2)  # compute-only's request is never loaded
    assert s.next_load(0) == LoadTask("cf", 0, 1)
    assert s.next_load(0) == LoadTask("cf", 0, 0)
    assert s.next_load(0) is None


def test_a_ready_predicate_holds_back_a_unit_without_claiming_it():
    s = scheduler("cake", plan("a", stage([1.0] * 2)), plan("b", stage([1.0] * 2), arrival=1.0))
    assert s.next_compute_batch(0, ready=lambda rid, unit: rid == "b") == [ComputeTask("b", 0)]
    assert s.next_compute_batch(0) == [ComputeTask("a", 0)]  # a's unit 0 was not claimed meanwhile


def test_a_cancelled_request_fails_and_its_loads_become_stale():
    s = scheduler("cake", plan("a", stage([1.0] * 2)))
    task = s.next_load(0)
    assert task is not None and s.cancel("a", "client went away")
    assert s.failed() == {"a": "client went away"} and not s.loaded(0, "a", task.unit)
    s.forget("a")
    assert s.failed() == {}


def test_a_channel_busy_with_higher_ranked_requests_is_not_counted_on():
    # Alone, `short`'s channel would load its last units (0.1 s each) before the 1 s step ends: compute
    # leaves them. Once a longer request that Algorithm 1 ranks higher queues 10 s of loads on the same
    # channel, the channel will not get to `short` soon, and compute takes its unit.
    alone = _loading("cacheflow-alg1", load=0.1, step=1.0)
    assert alone.next_compute_batch(0, now=0.0) == []
    crowded = _loading("cacheflow-alg1", load=0.1, step=1.0)
    crowded.arrive(plan("long", stage([5.0] * 10, load=1.0), arrival=1.0))
    assert crowded.next_compute_batch(0, now=0.0) == [ComputeTask("a", 0), ComputeTask("long", 0)]
