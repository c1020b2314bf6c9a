"""`cacheflow`'s two rules: a compute step advances the requests with the least remaining recomputation
(all that tie) and the oldest; the channels serve the oldest requests first, top unit down. Every-request
policies (Cake, `cacheflow-srpt`) still advance every request in every step."""

from __future__ import annotations

from cacheflow_common.sched import BatchScheduler, RequestPlan, StagePlan, make_policy
from cacheflow_common.sched.scheduler import ComputeTask, LoadTask


def stage(compute: list[float], channel: int = 0) -> StagePlan:
    n = len(compute)
    return StagePlan(n_layers=1, compute_s=tuple(compute), fixed_s=(0.0,) * n, load_s=(1.0,) * n,
                     load_channel=(channel,) * n, tokens=(1,) * n)


def request(rid: str, compute: list[float], arrival: float, policy: str | None = None, *,
            scheduler: BatchScheduler) -> None:
    """`rid` arrives at `scheduler`, under `policy` (None: the scheduler's default)."""
    plan = RequestPlan(request_id=rid, arrival_s=arrival, mode="token", n_tokens=len(compute),
                       stages=(stage(compute),))
    scheduler.arrive(plan, make_policy(policy) if policy else None)


def batch(policy: str) -> BatchScheduler:
    """Oldest is long; two short requests tie; a middle one is neither shortest nor oldest."""
    s = BatchScheduler(policy, n_stages=1)
    for rid, compute, arrival in (("old-long", [1.0] * 8, 0.0), ("middle", [1.0] * 4, 1.0),
                                  ("short-a", [1.0] * 2, 2.0), ("short-b", [1.0] * 2, 3.0)):
        request(rid, compute, arrival, scheduler=s)
    return s


def advanced(tasks: list[ComputeTask]) -> list[str]:
    return [t.request_id for t in tasks]


def test_a_cacheflow_step_advances_the_shortest_requests_and_the_oldest_only():
    s = batch("cacheflow")
    assert advanced(s.next_compute_batch(0)) == ["old-long", "short-a", "short-b"]  # arrival order
    s.computed(0, "old-long", 0)
    for rid in ("short-a", "short-b"):
        s.computed(0, rid, 0)
    assert advanced(s.next_compute_batch(0)) == ["old-long", "short-a", "short-b"]


def test_the_middle_request_computes_once_it_is_the_shortest_left():
    s = batch("cacheflow")
    for _ in range(2):  # the short ones finish in two steps
        for task in s.next_compute_batch(0):
            s.computed(0, task.request_id, task.unit)
    assert s.finished() == ["short-a", "short-b"]
    assert advanced(s.next_compute_batch(0)) == ["old-long", "middle"]


def test_every_request_policies_advance_every_request():
    for policy in ("cake", "cacheflow-srpt"):
        assert advanced(batch(policy).next_compute_batch(0)) == ["old-long", "middle", "short-a", "short-b"]


def test_mixed_policies_every_request_ones_always_compute():
    s = BatchScheduler("cacheflow", n_stages=1)
    request("old", [1.0] * 8, 0.0, scheduler=s)
    request("cake-long", [1.0] * 6, 1.0, "cake", scheduler=s)
    request("mid", [1.0] * 4, 2.0, scheduler=s)
    request("short", [1.0] * 2, 3.0, scheduler=s)
    assert advanced(s.next_compute_batch(0)) == ["old", "cake-long", "short"]


def test_cacheflow_channels_serve_the_oldest_request_from_its_top_unit_down():
    s = batch("cacheflow")
    assert s.next_load(0) == LoadTask("old-long", 0, 7)
    assert s.next_load(0) == LoadTask("old-long", 0, 6)
    srpt = batch("cacheflow-srpt")
    assert srpt.next_load(0) == LoadTask("short-a", 0, 1)  # the rule it replaced: least remaining first


def test_the_shortest_is_judged_among_requests_able_to_compute():
    """A short request whose next unit is not ready (its input has not arrived) leaves its place to the next
    shortest, not to nobody."""
    s = batch("cacheflow")
    ready = lambda rid, unit: not rid.startswith("short")  # noqa: E731
    assert advanced(s.next_compute_batch(0, ready=ready)) == ["old-long", "middle"]
