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
"""

from __future__ import annotations

from collections.abc import Callable

from cacheflow_common.restore.pointers import WAIT, Unit
from cacheflow_common.sched.policies import Policy
from cacheflow_common.sched.tasks import ComputeTask, LoadTask
from tests.common.sched_oracle.calibration import CALIBRATION_WEIGHT
from tests.common.sched_oracle.events import SchedulerEvents
from tests.common.sched_oracle.loads import InFlightLoad
from tests.common.sched_oracle.meeting import NEVER, BatchMeetingPoint
from tests.common.sched_oracle.ranking import ChannelRanking
from tests.common.sched_oracle.work import RequestWork

__all__ = ["CALIBRATION_WEIGHT", "NEVER", "BatchScheduler", "ComputeTask", "LoadTask", "Ready"]

Ready = Callable[[str, int], bool]  # (request id, unit) -> may the unit be computed now


class BatchScheduler(SchedulerEvents):
    """Decides what every stage computes and what every channel loads next, for a batch of requests."""

    def __init__(self, policy: Policy | str, *, n_stages: int) -> None:
        super().__init__(policy, n_stages=n_stages)
        self._ranking = ChannelRanking(self._calibration)
        self._meeting = BatchMeetingPoint(self._active, self._loads, self._calibration, self._ranking)

    def next_compute_batch(self, stage: int, max_tokens: int | None = None, *, now: float = 0.0,
                           ready: Ready | None = None) -> list[ComputeTask]:
        """Claim the next compute unit of every active request on `stage` that should compute one now."""
        if stage in self._lost_stages:
            return []
        chosen = self._chosen_few(stage, now, ready)
        batch: list[ComputeTask] = []
        tokens = 0
        for request in self._active.values():
            if request.policy.advances_few and request.request_id not in chosen:
                continue
            unit = self._unit_to_compute(request, stage, now, ready)
            if unit is None:
                continue
            work = request.stages[stage]
            size = work.plan.tokens[unit]
            if batch and max_tokens is not None and tokens + size > max_tokens:
                continue
            work.claim_compute(unit)
            batch.append(ComputeTask(request.request_id, unit))
            tokens += size
        return batch

    def next_load(self, channel: int, now: float = 0.0) -> LoadTask | None:
        """Claim the next load for `channel`: the top-ranked request, its busiest stage, its highest unit."""
        if channel in self._lost_channels:
            return None
        best = self._ranking.best(self._active.values(), channel, now)
        if best is None:
            return None
        request, stage, unit = best
        work = request.stages[stage]
        work.claim_load(unit)
        task = LoadTask(request.request_id, stage, unit)
        self._loads.start(task, InFlightLoad(channel, now, self._calibration.load_s(work, unit)))
        return task

    def _chosen_few(self, stage: int, now: float, ready: Ready | None) -> set[str]:
        """Of the requests whose policy advances few, those this step advances on `stage`: among the ones
        with a unit to compute now, those with the least remaining recomputation (all that tie: equal
        prefixes) and the oldest."""
        able = [r for r in self._active.values()
                if r.policy.advances_few and self._unit_to_compute(r, stage, now, ready) is not None]
        if not able:
            return set()
        least = min(r.remaining_s for r in able)
        return {r.request_id for r in able if r.remaining_s <= least} | {able[0].request_id}

    def _unit_to_compute(self, request: RequestWork, stage: int, now: float, ready: Ready | None) -> int | None:
        """The unit `request` should compute on `stage` now: its compute pointer's, if its input is `ready`
        and, when storage could still deliver it, the meeting point gives it to compute."""
        work = request.stages[stage]
        unit = work.pointers.next_compute()
        if unit is None or unit == WAIT or (ready is not None and not ready(request.request_id, unit)):
            return None
        if work.pointers.states[unit] is Unit.PENDING and not self._meeting.compute_takes(request, stage, unit, now):
            return None
        return unit
