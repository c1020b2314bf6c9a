"""The batch-aware scheduler (Algorithm 1 of the paper) as pure policy, driven by events.

Each request keeps its own two pointers per stage (`restore.pointers.TwoPointers`). The caller — the
worker loop or the simulator — asks for decisions and reports what happened:

    decisions                                     events
    next_compute_batch(stage) -> [(req, unit)]    arrive(plan)
    next_load(channel) -> (req, stage, unit)      computed / loaded / load_missed(stage, req, unit)
    finished(), failed()                          channel_lost(channel), stage_lost(stage)

* Compute advances every active request: a stage's batch holds the next compute unit of each request
  on that stage (oldest first, optionally capped in tokens; the oldest is always included).
* Each I/O channel (storage pod) serves the request the policy ranks highest among those with a
  pending unit stored on it — for CacheFlow the largest remaining recomputation cost, re-evaluated at
  every decision — and within it the stage with the most open work, at that stage's highest pending
  unit on the channel (the I/O pointer, walking down).
* A request is finished when its pointers have met on every stage. A lost channel turns its pending
  and in-flight loads into compute work; a lost stage fails the requests with units on it.

Events about loads the scheduler no longer tracks (their channel or request was lost) are stale: they
are ignored and return False. Anything else that breaks the protocol raises `InvalidTransitionError`.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from cacheflow_common.errors import BadRequestError
from cacheflow_common.restore.pointers import WAIT, InvalidTransitionError, Unit
from cacheflow_common.sched.plan import RequestPlan
from cacheflow_common.sched.policies import Policy, make_policy
from cacheflow_common.sched.work import RequestWork


class ComputeTask(NamedTuple):
    request_id: str
    unit: int


class LoadTask(NamedTuple):
    request_id: str
    stage: int
    unit: int


class BatchScheduler:
    """Decides what every stage computes and what every channel loads next, for a batch of requests."""

    def __init__(self, policy: Policy | str, *, n_stages: int) -> None:
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.n_stages = n_stages
        self.misses: Counter[str] = Counter()  # miss reasons reported by load_missed
        self._active: dict[str, RequestWork] = {}  # in arrival order
        self._loads: dict[LoadTask, int] = {}  # loads in flight -> their channel
        self._finished: dict[str, None] = {}  # in the order they finished
        self._failed: dict[str, str] = {}  # request -> why
        self._lost_channels: set[int] = set()
        self._lost_stages: set[int] = set()
        self._arrivals = 0

    # -- events ---------------------------------------------------------------------------------
    def arrive(self, plan: RequestPlan) -> None:
        if len(plan.stages) != self.n_stages:
            raise BadRequestError(f"request {plan.request_id} is planned for {len(plan.stages)} stages, "
                                  f"not {self.n_stages}")
        if plan.request_id in self._active or plan.request_id in self._failed or plan.request_id in self._finished:
            raise BadRequestError(f"request {plan.request_id} arrived twice")
        request = RequestWork(plan, order=self._arrivals)
        self._arrivals += 1
        self._active[plan.request_id] = request
        for channel in self._lost_channels:
            for stage in request.stages:
                stage.lose_channel(channel)
        lost = sorted(s for s in self._lost_stages if plan.stages[s].n_units)
        if lost:
            self._fail(request, f"stage {lost[0]} lost")
        else:
            self._finish_if_complete(request)

    def computed(self, stage: int, request_id: str, unit: int) -> bool:
        request = self._request(request_id)
        if request is None:
            return False
        request.stages[stage].pointers.computed(unit)
        self._finish_if_complete(request)
        return True

    def loaded(self, stage: int, request_id: str, unit: int) -> bool:
        if self._loads.pop(LoadTask(request_id, stage, unit), None) is None:
            return False
        request = self._active[request_id]
        request.stages[stage].pointers.loaded(unit)
        self._finish_if_complete(request)
        return True

    def load_missed(self, stage: int, request_id: str, unit: int, reason: str) -> bool:
        """The load failed (absent, corrupt, unreachable): the unit goes back to compute."""
        if self._loads.pop(LoadTask(request_id, stage, unit), None) is None:
            return False
        self._active[request_id].stages[stage].load_missed(unit)
        self.misses[reason] += 1
        return True

    def channel_lost(self, channel: int) -> None:
        """Storage behind `channel` is gone: its pending and in-flight loads become compute work."""
        self._lost_channels.add(channel)
        self._loads = {task: ch for task, ch in self._loads.items() if ch != channel}
        for request in self._active.values():
            for stage in request.stages:
                stage.lose_channel(channel)

    def stage_lost(self, stage: int) -> None:
        """A stage's worker is gone: every request with units on it fails (later events for it are stale)."""
        self._lost_stages.add(stage)
        for request in list(self._active.values()):
            if request.plan.stages[stage].n_units:
                self._fail(request, f"stage {stage} lost")

    # -- decisions ------------------------------------------------------------------------------
    def next_compute_batch(self, stage: int, max_tokens: int | None = None) -> list[ComputeTask]:
        """Claim the next compute unit of every active request on `stage` that has one ready."""
        if stage in self._lost_stages:
            return []
        batch: list[ComputeTask] = []
        tokens = 0
        for request in self._active.values():
            work = request.stages[stage]
            unit = work.pointers.next_compute()
            if unit is None or unit == WAIT:
                continue
            if work.pointers.states[unit] is Unit.PENDING and not self.policy.computes_pending:
                continue
            size = work.plan.tokens[unit]
            if batch and max_tokens is not None and tokens + size > max_tokens:
                continue
            work.claim_compute(unit)
            batch.append(ComputeTask(request.request_id, unit))
            tokens += size
        return batch

    def next_load(self, channel: int) -> LoadTask | None:
        """Claim the next load for `channel`: the policy's top request, its busiest stage, its highest unit."""
        if not self.policy.loads or channel in self._lost_channels:
            return None
        candidates = [r for r in self._active.values() if r.pending_on[channel] > 0]
        if not candidates:
            return None
        request = max(candidates, key=self.policy.load_rank)
        tops = {s: unit for s, work in enumerate(request.stages)
                if (unit := work.highest_pending_on(channel)) is not None}
        stage = max(tops, key=lambda s: (request.stages[s].open_s, -s))
        unit = tops[stage]
        request.stages[stage].claim_load(unit)
        task = LoadTask(request.request_id, stage, unit)
        self._loads[task] = channel
        return task

    # -- what the caller reads ------------------------------------------------------------------
    def finished(self) -> list[str]:
        """Requests whose pointers met on every stage, in the order they finished."""
        return list(self._finished)

    def failed(self) -> dict[str, str]:
        """Requests that cannot finish, and why."""
        return dict(self._failed)

    def is_finished(self, request_id: str) -> bool:
        return request_id in self._finished

    def active(self) -> list[str]:
        return list(self._active)

    def remaining_s(self, request_id: str) -> float:
        return self._active[request_id].remaining_s

    def unit_states(self, request_id: str, stage: int) -> list[Unit]:
        return list(self._active[request_id].stages[stage].pointers.states)

    # -- internals ------------------------------------------------------------------------------
    def _request(self, request_id: str) -> RequestWork | None:
        """The active request; None if it failed (its events are stale); an error if it never arrived."""
        request = self._active.get(request_id)
        if request is None and request_id not in self._failed:
            raise InvalidTransitionError(f"request {request_id} is not being restored")
        return request

    def _finish_if_complete(self, request: RequestWork) -> None:
        if request.complete():
            del self._active[request.request_id]
            self._finished[request.request_id] = None

    def _fail(self, request: RequestWork, reason: str) -> None:
        del self._active[request.request_id]
        self._failed[request.request_id] = reason
        self._loads = {task: ch for task, ch in self._loads.items() if task.request_id != request.request_id}
