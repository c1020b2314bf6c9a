"""The batch-aware scheduler (Algorithm 1 of the paper) as pure policy, driven by events.

Each request keeps its own two pointers per stage (`restore.pointers.TwoPointers`). The caller — a
stage worker's engine or the simulator — asks for decisions and reports what happened, with the time
(`now`, in whatever clock the caller keeps) where timing matters:

    decisions                                          events
    next_compute_batch(stage, max_tokens, now, ready)  arrive(plan, policy)
      -> [(req, unit)]                                  computed(stage, req, unit)
    next_load(channel, now) -> (req, stage, unit)      loaded(stage, req, unit, now) / load_missed(...)
    finished(), failed()                               step_done(stage, seconds)
                                                       channel_lost(channel), stage_lost(stage)

* Compute advances the active requests: a stage's batch holds the next compute unit of each request
  on that stage (oldest first, capped in tokens; the oldest is always included), unless its unit is
  not `ready` (its input has not arrived) or its policy would rather leave it to storage. Of the
  requests whose policy advances few (`cacheflow`), only these take part: the one with the least
  remaining recomputation (all that tie), so short requests leave the batch after a few cheap steps,
  and the oldest, so the slowest request keeps moving.
* Each I/O channel (storage pod) serves the request its policy ranks highest among those with a
  pending unit stored on it, re-evaluated at every decision; within it the stage with the most open
  work, at that stage's highest pending unit on the channel (the I/O pointer, walking down). A
  unit-ranking policy (`saving`) ranks the I/O pointers themselves, across the batch: the unit whose
  predicted compute seconds per load second are largest goes first.
* The meeting point of a planned (CacheFlow) request is decided against the whole batch: its next
  pending unit is computed only if the shared compute loop would get through the units up to the
  best split sooner than the channels would load the rest. Compute time is counted in whole steps of
  the stage's loop (the measured step time, which grows with what the batch asks of it); a channel
  reaches the request only after its load in flight and the pending units of every request it ranks
  higher; loads are counted at their predicted times, recalibrated from measured loads. While no load
  is in flight on its channels, a request computes: no event is sure to come.
* A request is finished when its pointers have met on every stage. A lost channel turns its pending
  and in-flight loads into compute work; a lost stage fails the requests with units on it.

Events about loads the scheduler no longer tracks (their channel or request was lost) are stale: they
are ignored and return False. Anything else that breaks the protocol raises `InvalidTransitionError`.

The parts, each in its own module: `records` (who is active, finished, failed; loads in flight) and
`events` (applying what the caller reports) are the bases of `BatchScheduler`, which makes the
decisions; `meeting` holds the meeting point rule, `ranking` the channels' choice, `calibration` what
measured loads and steps teach the predictions, `loads` the loads in flight, `tasks` what is handed out.
A decision costs what the requests it decides about cost, not a pass over the batch: `work` keeps each
request's aggregates and `index` (with `rank_order`) the batch's orders up to date at every event, in
exact sums of seconds (`exact`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from cacheflow_common.restore.pointers import WAIT, Unit
from cacheflow_common.sched.calibration import CALIBRATION_WEIGHT
from cacheflow_common.sched.events import SchedulerEvents
from cacheflow_common.sched.loads import InFlightLoad
from cacheflow_common.sched.meeting import BatchMeetingPoint
from cacheflow_common.sched.policies import Policy
from cacheflow_common.sched.ranking import ChannelRanking
from cacheflow_common.sched.tasks import ComputeTask, LoadTask
from cacheflow_common.sched.work import RequestWork

__all__ = ["CALIBRATION_WEIGHT", "BatchScheduler", "ComputeTask", "LoadTask", "Ready"]

Ready = Callable[[str, int], bool]  # (request id, unit) -> may the unit be computed now


class BatchScheduler(SchedulerEvents):
    """Decides what every stage computes and what every channel loads next, for a batch of requests."""

    def __init__(self, policy: Policy | str, *, n_stages: int) -> None:
        super().__init__(policy, n_stages=n_stages)
        self._ranking = ChannelRanking(self._calibration, self._index)
        self._meeting = BatchMeetingPoint(self._active, self._loads, self._calibration, self._ranking, self._index)

    def next_compute_batch(self, stage: int, max_tokens: int | None = None, *, now: float = 0.0,
                           ready: Ready | None = None) -> list[ComputeTask]:
        """Claim the next compute unit of every active request on `stage` that should compute one now.

        Requests are taken in arrival order (every-request ones, and the chosen few); a unit that does not
        fit the step's token budget is passed over before its meeting point is asked, and once no unit of
        any active request could fit, the rest are not looked at."""
        if stage in self._lost_stages:
            return []
        self._index.sync(now)
        able: dict[RequestWork, bool] = {}  # the few asked before anything was claimed, and the answers
        chosen = sorted(self._chosen_few(stage, now, ready, able), key=_arrival)
        batch: list[ComputeTask] = []
        tokens = 0
        every = self._index.every_by_arrival()
        for request in heapq.merge(every, chosen, key=_arrival) if chosen else every:
            if batch and max_tokens is not None and max_tokens - tokens < self._index.smallest_unit():
                break
            unit = _next_unit(request, stage)
            if unit is None:
                continue
            work = request.stages[stage]
            size = work.plan.tokens[unit]
            if batch and max_tokens is not None and tokens + size > max_tokens:
                continue
            if not (able[request] if not batch and request in able  # nothing claimed since it was asked
                    else self._may_compute(request, stage, unit, now, ready)):
                continue
            work.claim_compute(unit)
            self._index.refresh(request)
            batch.append(ComputeTask(request.request_id, unit))
            tokens += size
        return batch

    def next_load(self, channel: int, now: float = 0.0) -> LoadTask | None:
        """Claim the next load for `channel`: the top-ranked request, its busiest stage, its highest unit."""
        if channel in self._lost_channels:
            return None
        self._index.sync(now)
        best = self._ranking.best(channel, now)
        if best is None:
            return None
        request, stage, unit = best
        work = request.stages[stage]
        work.claim_load(unit)
        self._index.refresh(request)
        task = LoadTask(request.request_id, stage, unit)
        self._loads.start(task, InFlightLoad(channel, now, self._calibration.load_s(work, unit)))
        return task

    def _chosen_few(self, stage: int, now: float, ready: Ready | None, able: dict[RequestWork, bool]
                    ) -> set[RequestWork]:
        """Of the requests whose policy advances few, those this step advances on `stage`: among the ones
        with a unit to compute now, those with the least remaining recomputation (all that tie: equal
        prefixes) and the oldest. Walks them by remaining recomputation up to the first able to compute
        and its ties, and by arrival up to the first able; `able` gets every answer (each asked once:
        nothing changes until the batch claims)."""

        def can(request: RequestWork) -> bool:
            if request not in able:
                unit = _next_unit(request, stage)
                able[request] = unit is not None and self._may_compute(request, stage, unit, now, ready)
            return able[request]

        chosen: set[RequestWork] = set()
        least: float | None = None
        for request in self._index.fewest_first():
            if least is not None and request.remaining_s > least:
                break
            if can(request):
                least = request.remaining_s if least is None else least
                chosen.add(request)
        oldest = next((request for request in self._index.few_by_arrival() if can(request)), None)
        return chosen | {oldest} if oldest is not None else chosen

    def _may_compute(self, request: RequestWork, stage: int, unit: int, now: float, ready: Ready | None) -> bool:
        """Whether `request` should compute `unit` (its compute pointer's) on `stage` now: its input is `ready`
        and, when storage could still deliver it, the meeting point gives it to compute."""
        if ready is not None and not ready(request.request_id, unit):
            return False
        work = request.stages[stage]
        return work.pointers.states[unit] is not Unit.PENDING or self._meeting.compute_takes(request, stage, unit, now)


def _next_unit(request: RequestWork, stage: int) -> int | None:
    """The unit `request`'s compute pointer would take on `stage` now, if any (not `WAIT`)."""
    unit = request.stages[stage].pointers.next_compute()
    return None if unit is None or unit == WAIT else unit


def _arrival(request: RequestWork) -> int:
    return request.order
