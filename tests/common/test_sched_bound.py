"""The batch bound: never above the best schedule an exhaustive search finds on tiny batches, and equal
to it where the relaxation is tight (one request; requests that never meet; a pure compute / load pair)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import pytest

from cacheflow_common.sched import NOT_STORED, RequestPlan, StagePlan
from cacheflow_common.sched.bound import BoundRequest, batch_bound

Op = tuple[int, int, int]  # request, stage, unit


def plan(rid: str, compute: list[float], load: list[float], channels: list[int], *, arrival: float = 0.0,
         stages: int = 1) -> RequestPlan:
    n = len(compute)
    st = StagePlan(n_layers=1, compute_s=tuple(compute), fixed_s=(0.0,) * n, load_s=tuple(load),
                   load_channel=tuple(channels), tokens=(1,) * n)
    return RequestPlan(request_id=rid, arrival_s=arrival, mode="token", n_tokens=n, stages=(st,) * stages)


def best_schedules(plans: list[RequestPlan], tails: list[float]) -> tuple[float, float]:
    """(best mean TTFT, best slowest TTFT) over every split and every order of the units on each stage
    and channel (semi-active schedules: each op starts as soon as its resource, its arrival and, for a
    computed unit, every unit below it allow; a unit runs alone on its resource for its whole cost)."""
    ops = [(i, s, u) for i, p in enumerate(plans) for s, st in enumerate(p.stages) for u in range(st.n_units)]
    best_mean = best_max = float("inf")
    for split in itertools.product((False, True), repeat=len(ops)):  # True: loaded
        loads = dict(zip(ops, split, strict=True))
        if any(loads[o] and plans[o[0]].stages[o[1]].load_channel[o[2]] == NOT_STORED for o in ops):
            continue
        for finish in _orders(plans, ops, loads):
            ttft = [max([finish[o] for o in ops if o[0] == i], default=p.arrival_s) + tails[i] - p.arrival_s
                    for i, p in enumerate(plans)]
            best_mean = min(best_mean, sum(ttft) / len(ttft))
            best_max = min(best_max, max(ttft))
    return best_mean, best_max


def _orders(plans: list[RequestPlan], ops: list[Op], loads: dict[Op, bool]) -> Iterator[dict[Op, float]]:
    """Every semi-active schedule of a split: finish time per op."""
    def resource(o: Op) -> tuple[str, int]:
        return ("ch", plans[o[0]].stages[o[1]].load_channel[o[2]]) if loads[o] else ("st", o[1])

    groups: dict[tuple[str, int], list[Op]] = {}
    for o in ops:
        groups.setdefault(resource(o), []).append(o)
    keys = sorted(groups, key=lambda k: k[0])  # channels first: loads wait on nothing
    for perms in itertools.product(*(itertools.permutations(groups[k]) for k in keys)):
        finish: dict[Op, float] = {}
        ok = True
        for key, order in zip(keys, perms, strict=True):
            free = 0.0
            for o in order:
                i, s, u = o
                start = max(free, plans[i].arrival_s)
                if key[0] == "st":
                    below = [(i, s, v) for v in range(u)]
                    if any(b not in finish for b in below):
                        ok = False
                        break
                    start = max([start, *(finish[b] for b in below)])
                    cost = plans[i].stages[s].compute_s[u]
                else:
                    cost = plans[i].stages[s].load_s[u]
                finish[o] = free = start + cost
            if not ok:
                break
        if ok:
            yield finish


def bound(plans: list[RequestPlan], tails: list[float] | None = None, slots: int = 40) -> tuple[float, float]:
    tails = tails or [0.0] * len(plans)
    b = batch_bound([BoundRequest(plan=p, tail_s=t) for p, t in zip(plans, tails, strict=True)], slots=slots)
    return b.mean_ttft_s, b.max_ttft_s


def test_one_request_is_the_two_pointer_optimum() -> None:
    plans = [plan("a", [1.0, 1.0], [1.0, 1.0], [0, 0])]
    assert bound(plans) == pytest.approx((1.0, 1.0), abs=1e-5)
    assert best_schedules(plans, [0.0]) == pytest.approx((1.0, 1.0))


def test_requests_that_never_meet_are_each_alone() -> None:
    plans = [plan("a", [1.0, 1.0], [1.0, 1.0], [0, 0]), plan("b", [2.0, 2.0], [2.0, 2.0], [0, 0], arrival=10.0)]
    assert bound(plans) == pytest.approx((1.5, 2.0), abs=1e-5)
    assert best_schedules(plans, [0.0, 0.0]) == pytest.approx((1.5, 2.0))


def test_a_compute_only_and_a_load_only_request_share_nothing() -> None:
    plans = [plan("a", [1.0], [1.0], [NOT_STORED]), plan("b", [5.0], [1.0], [0])]
    best = best_schedules(plans, [0.0, 0.0])
    assert best == pytest.approx((1.0, 1.0))
    assert bound(plans)[1] == pytest.approx(best[1], abs=1e-5)  # the slowest: a's chain is the bound
    assert bound(plans)[0] <= best[0] + 1e-9


def test_the_tail_adds_after_the_restore() -> None:
    plans = [plan("a", [1.0, 1.0], [1.0, 1.0], [0, 0])]
    assert bound(plans, [0.5]) == pytest.approx((1.5, 1.5), abs=1e-5)


def test_capacity_binds_when_requests_compete() -> None:
    """Two identical requests at once on one stage and one channel: 4 units of work, 2 resources; the
    later one cannot finish before 2 s whatever the split, so the slowest-request bound is 2 s."""
    plans = [plan(r, [1.0, 1.0], [1.0, 1.0], [0, 0]) for r in "ab"]
    mean, worst = bound(plans)
    assert worst == pytest.approx(2.0, abs=1e-5)
    assert 1.0 < mean <= best_schedules(plans, [0.0, 0.0])[0] + 1e-9


@pytest.mark.parametrize("seed", range(12))
def test_never_above_the_best_schedule(seed: int) -> None:
    rng = random.Random(seed)
    n_channels = rng.randint(1, 2)
    plans = []
    for i in range(2):
        n = rng.randint(1, 2)
        plans.append(plan(f"r{i}", [round(rng.uniform(0.2, 3), 2) for _ in range(n)],
                          [round(rng.uniform(0.2, 3), 2) for _ in range(n)],
                          [rng.randint(NOT_STORED, n_channels - 1) for _ in range(n)],
                          arrival=rng.choice((0.0, 0.0, 0.5, 2.0))))
    tails = [rng.choice((0.0, 0.3)) for _ in plans]
    best_mean, best_max = best_schedules(plans, tails)
    mean, worst = bound(plans, tails, slots=8)
    assert mean <= best_mean + 1e-5
    assert worst <= best_max + 1e-5
    assert mean > 0 and worst >= mean - 1e-9


def test_admission_makes_requests_that_share_nothing_wait() -> None:
    """Two requests, each held by its own channel (its one unit split divisibly: 100/101 s alone), finish
    together at about 1 s; one admission slot makes one wait for the other: the slowest at twice its
    time alone, the mean at 1.5 times (less at most one grid slot)."""
    plans = [plan("a", [100.0], [1.0], [0]), plan("b", [100.0], [1.0], [1])]
    free = batch_bound([BoundRequest(plan=p) for p in plans], horizon_s=2.0)
    one = batch_bound([BoundRequest(plan=p) for p in plans], horizon_s=2.0, max_batch=1)
    assert free.max_ttft_s == pytest.approx(200 / 201, abs=1e-5)  # both compute a little on the one stage
    assert one.max_ttft_s == pytest.approx(2 * 100 / 101, abs=1e-5)
    assert 1.5 * 100 / 101 - 2.0 / 40 - 1e-6 <= one.mean_ttft_s <= 1.5 * 100 / 101 + 1e-6
