"""The events a caller reports to the scheduler (arrivals, units restored, loads missed, steps timed,
channels and stages lost), applied to its records; the decisions are `BatchScheduler`'s.

Events about loads the scheduler no longer tracks (their channel or request was lost) are stale: they
are ignored and return False. Anything else that breaks the protocol raises `InvalidTransitionError`.
"""

from __future__ import annotations

from collections import Counter

from cacheflow_common.errors import BadRequestError
from cacheflow_common.sched.calibration import Calibration
from cacheflow_common.sched.plan import RequestPlan
from cacheflow_common.sched.policies import Policy, make_policy
from cacheflow_common.sched.records import RequestRecords
from cacheflow_common.sched.tasks import LoadTask
from cacheflow_common.sched.work import RequestWork


class SchedulerEvents(RequestRecords):
    """Keeps the records, the lost channels and stages and the calibration up to date with what happened."""

    def __init__(self, policy: Policy | str, *, n_stages: int) -> None:
        super().__init__()
        self.policy = make_policy(policy) if isinstance(policy, str) else policy  # the default per request
        self.n_stages = n_stages
        self.misses: Counter[str] = Counter()  # miss reasons reported by load_missed
        self._calibration = Calibration()
        self._lost_channels: set[int] = set()
        self._lost_stages: set[int] = set()
        self._arrivals = 0

    def arrive(self, plan: RequestPlan, policy: Policy | None = None) -> RequestWork:
        """A request to restore, under `policy` (the scheduler's own if None); returns the scheduler's record of
        it: its units' states are the one place they are kept (read them, never move them)."""
        if len(plan.stages) != self.n_stages:
            raise BadRequestError(f"request {plan.request_id} is planned for {len(plan.stages)} stages, "
                                  f"not {self.n_stages}")
        if plan.request_id in self._active or plan.request_id in self._failed or plan.request_id in self._finished:
            raise BadRequestError(f"request {plan.request_id} arrived twice")
        request = RequestWork(plan, order=self._arrivals, policy=policy or self.policy)
        self._arrivals += 1
        self._active[plan.request_id] = request
        for channel in self._lost_channels:
            for stage in request.stages:
                stage.lose_channel(channel)
        self._index.add(request)
        lost = sorted(s for s in self._lost_stages if plan.stages[s].n_units)
        if lost:
            self._fail(request, f"stage {lost[0]} lost")
        else:
            self._finish_if_complete(request)
        return request

    def computed(self, stage: int, request_id: str, unit: int) -> bool:
        request = self._request(request_id)
        if request is None:
            return False
        request.stages[stage].pointers.computed(unit)
        self._finish_if_complete(request)
        return True

    def loaded(self, stage: int, request_id: str, unit: int, now: float | None = None) -> bool:
        """The load landed; with `now`, its measured time recalibrates the load predictions."""
        load = self._loads.end(LoadTask(request_id, stage, unit))
        if load is None:
            return False
        self._calibration.load_landed(load, now)
        request = self._active[request_id]
        request.stages[stage].pointers.loaded(unit)
        self._finish_if_complete(request)
        return True

    def load_missed(self, stage: int, request_id: str, unit: int, reason: str) -> bool:
        """The load failed (absent, corrupt, unreachable): the unit goes back to compute."""
        if self._loads.end(LoadTask(request_id, stage, unit)) is None:
            return False
        request = self._active[request_id]
        request.stages[stage].load_missed(unit)
        self._index.refresh(request)
        self.misses[reason] += 1
        return True

    def step_done(self, stage: int, seconds: float) -> None:
        """A compute step of `stage` took `seconds`: what the next one is expected to take."""
        self._calibration.step_done(stage, seconds)

    def channel_lost(self, channel: int) -> None:
        """Storage behind `channel` is gone: its pending and in-flight loads become compute work."""
        self._lost_channels.add(channel)
        self._loads.drop_channel(channel)
        for request in self._active.values():
            for stage in request.stages:
                stage.lose_channel(channel)
            self._index.refresh(request)

    def stage_lost(self, stage: int) -> None:
        """A stage's worker is gone: every request with units on it fails (later events for it are stale)."""
        self._lost_stages.add(stage)
        for request in list(self._active.values()):
            if request.plan.stages[stage].n_units:
                self._fail(request, f"stage {stage} lost")

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        """Stop restoring a request (its client went away); its loads in flight become stale."""
        request = self._active.get(request_id)
        if request is None:
            return False
        self._fail(request, reason)
        return True
