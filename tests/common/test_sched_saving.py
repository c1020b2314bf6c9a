"""The `saving` channel rule: a free channel loads, across the whole batch, the I/O-pointer unit that saves
the most predicted recomputation per second of link; the compute loop still takes every request's next
unit (short requests keep finishing early); restores still complete with the pointers met."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cacheflow_common.restore.pointers import Unit
from cacheflow_common.sched import NOT_STORED, BatchScheduler, RequestPlan, StagePlan


def random_plans(rng: random.Random, n_requests: int, n_stages: int, n_channels: int) -> list[RequestPlan]:
    plans = []
    for i in range(n_requests):
        n = rng.randint(1, 12)
        stages = tuple(StagePlan(
            n_layers=1,
            compute_s=tuple(sorted(rng.uniform(0.1, 5) for _ in range(n))),  # later chunks cost more
            fixed_s=(0.0,) * n,
            load_s=tuple(rng.uniform(0.5, 2) for _ in range(n)),
            load_channel=tuple(rng.randint(NOT_STORED, n_channels - 1) for _ in range(n)),
            tokens=(64,) * n,
        ) for _ in range(n_stages))
        plans.append(RequestPlan(request_id=f"r{i}", arrival_s=0.01 * i, mode="token", n_tokens=64 * n, stages=stages))
    return plans


Candidate = tuple[float, str, int, int]  # compute / load, request, stage, unit


def pointer_candidates(s: BatchScheduler, plans: dict[str, RequestPlan], channel: int) -> list[Candidate]:
    """(compute / load, request, stage, unit) of every I/O pointer on `channel`: each request's and stage's
    highest pending unit held there."""
    out = []
    for rid in s.active():
        for stage, sp in enumerate(plans[rid].stages):
            states = s.unit_states(rid, stage)
            pending = [u for u in range(sp.n_units) if states[u] is Unit.PENDING and sp.load_channel[u] == channel]
            if pending:
                u = max(pending)
                out.append((sp.compute_s[u] / sp.load_s[u], rid, stage, u))
    return out


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), n_stages=st.integers(1, 3), n_channels=st.integers(1, 3))
def test_a_free_channel_takes_the_largest_saving_per_link_second(seed: int, n_stages: int, n_channels: int) -> None:
    rng = random.Random(seed)
    plans = {p.request_id: p for p in random_plans(rng, rng.randint(1, 6), n_stages, n_channels)}
    s = BatchScheduler("cacheflow-saving", n_stages=n_stages)
    for p in plans.values():
        s.arrive(p)
    for _ in range(rng.randint(0, 8)):  # some compute first, so pointers sit at random places
        stage = rng.randrange(n_stages)
        for computed in s.next_compute_batch(stage):
            s.computed(stage, computed.request_id, computed.unit)
    for _ in range(10):
        channel = rng.randrange(n_channels)
        candidates = pointer_candidates(s, plans, channel)
        task = s.next_load(channel)
        if not candidates:
            assert task is None
            continue
        assert task is not None
        chosen = plans[task.request_id].stages[task.stage]
        best = max(c[0] for c in candidates)
        assert chosen.compute_s[task.unit] / chosen.load_s[task.unit] >= best - 1e-6
        assert (chosen.compute_s[task.unit] / chosen.load_s[task.unit], task.request_id, task.stage,
                task.unit) in candidates


def test_io_goes_to_the_late_chunks_of_the_long_prefix() -> None:
    """A short prefix of cheap chunks and a long one whose late chunks cost the most: the channel loads the
    long prefix's top chunks, while least-remaining-first (SRPT) serves the short request first."""
    short = RequestPlan(request_id="short", arrival_s=0.0, mode="token", n_tokens=128, stages=(StagePlan(
        n_layers=1, compute_s=(0.1, 0.12), fixed_s=(0.0,) * 2, load_s=(1.0,) * 2, load_channel=(0, 0),
        tokens=(64,) * 2),))
    long = RequestPlan(request_id="long", arrival_s=0.0, mode="token", n_tokens=640, stages=(StagePlan(
        n_layers=1, compute_s=tuple(0.1 + 0.1 * u for u in range(10)), fixed_s=(0.0,) * 10, load_s=(1.0,) * 10,
        load_channel=(0,) * 10, tokens=(64,) * 10),))
    picks = {}
    for policy in ("cacheflow-saving", "cacheflow-srpt"):
        s = BatchScheduler(policy, n_stages=1)
        s.arrive(short)
        s.arrive(long)
        picks[policy] = [s.next_load(0) for _ in range(3)]
    assert [(t.request_id, t.unit) for t in picks["cacheflow-saving"] if t] == [("long", 9), ("long", 8), ("long", 7)]
    assert picks["cacheflow-srpt"][0] is not None and picks["cacheflow-srpt"][0].request_id == "short"


def test_the_compute_loop_still_takes_every_request() -> None:
    """While the channel serves the long prefix, the short one is computed in the same steps and finishes
    first; both restores complete with every unit restored once."""
    short = RequestPlan(request_id="short", arrival_s=0.0, mode="token", n_tokens=128, stages=(StagePlan(
        n_layers=1, compute_s=(0.1, 0.12), fixed_s=(0.0,) * 2, load_s=(1.0,) * 2, load_channel=(0, 0),
        tokens=(64,) * 2),))
    long = RequestPlan(request_id="long", arrival_s=0.0, mode="token", n_tokens=384, stages=(StagePlan(
        n_layers=1, compute_s=tuple(0.5 + 0.5 * u for u in range(6)), fixed_s=(0.0,) * 6, load_s=(1.0,) * 6,
        load_channel=(0,) * 6, tokens=(64,) * 6),))
    s = BatchScheduler("cacheflow-saving", n_stages=1)
    s.arrive(short)
    s.arrive(long)
    in_flight = s.next_load(0)
    assert in_flight is not None and in_flight.request_id == "long"
    batch = s.next_compute_batch(0, now=0.0)
    assert {t.request_id for t in batch} == {"short", "long"}
    for _ in range(20):
        for t in batch:
            s.computed(0, t.request_id, t.unit)
        if in_flight is not None:
            s.loaded(0, in_flight.request_id, in_flight.unit)
        in_flight = s.next_load(0)
        batch = s.next_compute_batch(0, now=0.0)
        if not batch and in_flight is None:
            break
    assert s.finished()[0] == "short" and set(s.finished()) == {"short", "long"}
