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

* Compute advances every active request: a stage's batch holds the next compute unit of each request
  on that stage (oldest first, capped in tokens; the oldest is always included), unless its unit is
  not `ready` (its input has not arrived) or its policy would rather leave it to storage.
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
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

from cacheflow_common.errors import BadRequestError
from cacheflow_common.restore.pointers import WAIT, InvalidTransitionError, Unit
from cacheflow_common.sched.plan import NOT_STORED, RequestPlan
from cacheflow_common.sched.policies import Policy, make_policy
from cacheflow_common.sched.work import RequestWork, StageWork

# How fast calibration follows measurements: 0.3 tracks a machine whose speed drifts without chasing
# one noisy load or step.
CALIBRATION_WEIGHT = 0.3
NEVER = float("inf")  # a unit no channel is loading for its request: it will not arrive on its own

Ready = Callable[[str, int], bool]  # (request id, unit) -> may the unit be computed now


class ComputeTask(NamedTuple):
    request_id: str
    unit: int


class LoadTask(NamedTuple):
    request_id: str
    stage: int
    unit: int


class _Load(NamedTuple):
    channel: int
    started_s: float
    predicted_s: float  # calibrated prediction when it started


class BatchScheduler:
    """Decides what every stage computes and what every channel loads next, for a batch of requests."""

    def __init__(self, policy: Policy | str, *, n_stages: int) -> None:
        self.policy = make_policy(policy) if isinstance(policy, str) else policy  # the default per request
        self.n_stages = n_stages
        self.misses: Counter[str] = Counter()  # miss reasons reported by load_missed
        self._active: dict[str, RequestWork] = {}  # in arrival order
        self._loads: dict[LoadTask, _Load] = {}  # loads in flight
        self._finished: dict[str, None] = {}  # in the order they finished
        self._failed: dict[str, str] = {}  # request -> why
        self._lost_channels: set[int] = set()
        self._lost_stages: set[int] = set()
        self._arrivals = 0
        self._load_scale = 1.0  # measured / predicted load time (calibration)
        self._step_s: dict[int, float] = {}  # stage -> measured seconds per compute step (moving average)

    # -- events ---------------------------------------------------------------------------------
    def arrive(self, plan: RequestPlan, policy: Policy | None = None) -> None:
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

    def loaded(self, stage: int, request_id: str, unit: int, now: float | None = None) -> bool:
        """The load landed; with `now`, its measured time recalibrates the load predictions."""
        load = self._loads.pop(LoadTask(request_id, stage, unit), None)
        if load is None:
            return False
        if now is not None and load.predicted_s > 0:
            measured = (now - load.started_s) / load.predicted_s * self._load_scale
            self._load_scale += CALIBRATION_WEIGHT * (measured - self._load_scale)
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

    def step_done(self, stage: int, seconds: float) -> None:
        """A compute step of `stage` took `seconds`: what the next one is expected to take."""
        previous = self._step_s.get(stage)
        self._step_s[stage] = seconds if previous is None else previous + CALIBRATION_WEIGHT * (seconds - previous)

    def channel_lost(self, channel: int) -> None:
        """Storage behind `channel` is gone: its pending and in-flight loads become compute work."""
        self._lost_channels.add(channel)
        self._loads = {task: load for task, load in self._loads.items() if load.channel != channel}
        for request in self._active.values():
            for stage in request.stages:
                stage.lose_channel(channel)

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

    # -- decisions ------------------------------------------------------------------------------
    def next_compute_batch(self, stage: int, max_tokens: int | None = None, *, now: float = 0.0,
                           ready: Ready | None = None) -> list[ComputeTask]:
        """Claim the next compute unit of every active request on `stage` that should compute one now."""
        if stage in self._lost_stages:
            return []
        batch: list[ComputeTask] = []
        tokens = 0
        for request in self._active.values():
            work = request.stages[stage]
            unit = work.pointers.next_compute()
            if unit is None or unit == WAIT or (ready is not None and not ready(request.request_id, unit)):
                continue
            if work.pointers.states[unit] is Unit.PENDING and not self._compute_takes(request, stage, unit, now):
                continue
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
        best: tuple[tuple[float, ...], RequestWork, int, int] | None = None
        for request in self._active.values():
            if not request.policy.loads or request.pending_on[channel] <= 0:
                continue
            stage, unit, rank = self._channel_choice(request, channel, now)
            if best is None or rank > best[0]:
                best = (rank, request, stage, unit)
        if best is None:
            return None
        _, request, stage, unit = best
        request.stages[stage].claim_load(unit)
        task = LoadTask(request.request_id, stage, unit)
        self._loads[task] = _Load(channel, now, self._predicted_load_s(request.stages[stage], unit))
        return task

    def _channel_choice(self, request: RequestWork, channel: int, now: float) -> tuple[int, int, tuple[float, ...]]:
        """(stage, unit, rank) a free `channel` would load for `request`: among its stages' I/O pointers on the
        channel, the unit saving the most compute per link-second (a unit-ranking policy) or the stage with
        the most open work; ranked by the policy."""
        tops = {s: unit for s, work in enumerate(request.stages)
                if (unit := work.highest_pending_on(channel)) is not None}
        policy = request.policy
        if policy.ranks_units:
            ranks = {s: policy.unit_rank(request, request.stages[s].plan.compute_s[u],
                                         self._predicted_load_s(request.stages[s], u), now) for s, u in tops.items()}
            stage = max(tops, key=lambda s: (ranks[s], -s))
            return stage, tops[stage], ranks[stage]
        stage = max(tops, key=lambda s: (request.stages[s].open_s, -s))
        return stage, tops[stage], policy.load_rank(request, now)

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

    def forget(self, request_id: str) -> None:
        """Drop a finished or failed request's record (a long-running worker would keep them all)."""
        self._finished.pop(request_id, None)
        self._failed.pop(request_id, None)

    # -- the batch-level meeting point ----------------------------------------------------------
    def _compute_takes(self, request: RequestWork, stage: int, unit: int, now: float) -> bool:
        """May compute take `unit`, which storage could still deliver?"""
        policy = request.policy
        if not policy.computes_pending:
            return False
        if not policy.plans_meeting:
            return True  # Cake: the pointers meet wherever they meet
        work = request.stages[stage]
        pending = list(work.pointers.pending_span())  # the units between the pointers, `unit` first
        channels = {work.plan.load_channel[u] for u in pending if work.pointers.states[u] is Unit.PENDING}
        busy = {load.channel: load for load in self._loads.values() if load.channel in channels}
        if not busy:
            return True  # no load is in flight on its channels: no event is sure to come, compute goes on
        step_s = self._step_s.get(stage) or work.plan.compute_s[unit]
        return self._best_split(request, stage, pending, busy, step_s, now) > 0

    def _best_split(self, request: RequestWork, stage: int, pending: list[int], busy: dict[int, _Load],
                    step_s: float, now: float) -> int:
        """How many of `pending` (lowest first) compute should take: the split that ends the restore first.

        Compute gets through one unit per step of the stage's loop, at the step time the whole batch
        makes. A channel gets to this request's units once it has loaded what is in flight on it and the
        pending units of every request it ranks higher; then it loads this request's units from the top
        down. A unit no channel holds stays on the compute side.
        """
        work = request.stages[stage]
        position = {u: i for i, u in enumerate(pending)}
        blocked_below = 0  # every split must lie above the highest unit that cannot be loaded
        load_after: list[list[float]] = []  # per channel: seconds until its loads of units >= k are done
        on_channels: set[int] = set()
        for channel in {work.plan.load_channel[u] for u in pending} - {NOT_STORED}:
            mine = [0.0] * (len(pending) + 1)
            for u in work.pending_on_channel(channel):
                on_channels.add(u)
                mine[position[u]] += self._predicted_load_s(work, u)
            for k in reversed(range(len(pending))):
                mine[k] += mine[k + 1]
            ahead = self._ahead_on(channel, request, busy.get(channel), now)
            load_after.append([t + ahead for t in mine])
        for i, u in enumerate(pending):
            if u not in on_channels:
                blocked_below = i + 1
        best_k, best_t = len(pending), NEVER
        for k in range(blocked_below, len(pending) + 1):
            t = max(k * step_s, max((channel_s[k] for channel_s in load_after), default=0.0))
            if t < best_t:
                best_k, best_t = k, t
        return best_k

    def _ahead_on(self, channel: int, request: RequestWork, in_flight: _Load | None, now: float) -> float:
        """Seconds before `channel` can load for `request`: its load in flight, then every request it
        ranks higher (the whole batch's claim on the channel, at the current ranking)."""
        ahead = max(0.0, in_flight.started_s + in_flight.predicted_s - now) if in_flight else 0.0
        if request.policy.ranks_units:
            return ahead + self._units_ahead(channel, request, now)
        rank = request.policy.load_rank(request, now)
        for other in self._active.values():
            if other is request or not other.policy.loads or not other.pending_on[channel]:
                continue
            if other.policy.load_rank(other, now) > rank:
                ahead += sum(self._predicted_load_s(w, u) for w in other.stages for u in w.pending_on_channel(channel))
        return ahead

    def _units_ahead(self, channel: int, request: RequestWork, now: float) -> float:
        """Load seconds `channel` spends on other requests' units before this request's I/O pointer: every
        pending unit there that ranks above the request's best unit on the channel (units are taken in
        rank order across the batch, each request's from the top down)."""
        if not request.pending_on[channel]:
            return 0.0
        _, _, mine = self._channel_choice(request, channel, now)
        ahead = 0.0
        for other in self._active.values():
            if other is request or not other.policy.loads or not other.pending_on[channel]:
                continue
            for work in other.stages:
                for u in work.pending_on_channel(channel):
                    load_s = self._predicted_load_s(work, u)
                    if other.policy.unit_rank(other, work.plan.compute_s[u], load_s, now) > mine:
                        ahead += load_s
        return ahead

    def _predicted_load_s(self, work: StageWork, unit: int) -> float:
        return work.plan.load_s[unit] * self._load_scale

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
        self._loads = {task: load for task, load in self._loads.items() if task.request_id != request.request_id}
