"""The scheduler's bookkeeping for one request: its two pointers on every stage, plus what ranking
and channel choice need fast (open compute cost, pending units per channel, highest pending unit).
"""

from __future__ import annotations

from collections import Counter

from cacheflow_common.restore.pointers import OPEN, TwoPointers, Unit
from cacheflow_common.sched.plan import NOT_STORED, RequestPlan, StagePlan
from cacheflow_common.sched.policies import Policy


class StageWork:
    """One request's restore on one stage: the pointer state machine, annotated with the plan's costs."""

    def __init__(self, plan: StagePlan, *, token_mode: bool, pending_on: Counter[int]) -> None:
        self.plan = plan
        self.pointers = TwoPointers(plan.n_units, compute_skips_loaded=token_mode)
        self.open_s = sum(plan.compute_s)  # predicted compute seconds of units nobody restored or claimed
        self._pending_on = pending_on  # shared by the request's stages: channel -> its PENDING units
        self._by_channel: dict[int, list[int]] = {}  # channel -> the units it holds, highest first
        self._cursor: dict[int, int] = {}  # channel -> index in _by_channel of its highest PENDING unit
        for unit in reversed(range(plan.n_units)):
            channel = plan.load_channel[unit]
            if channel == NOT_STORED:
                self.pointers.missed(unit)
            else:
                self._by_channel.setdefault(channel, []).append(unit)
                pending_on[channel] += 1

    def pending_on_channel(self, channel: int) -> list[int]:
        """The units `channel` could still load for this stage, highest first (the order it loads them)."""
        return [u for u in self._by_channel.get(channel, []) if self.pointers.states[u] is Unit.PENDING]

    def highest_pending_on(self, channel: int) -> int | None:
        """The I/O pointer for `channel`: its highest unit still PENDING (units never return to PENDING)."""
        units = self._by_channel.get(channel, [])
        i = self._cursor.get(channel, 0)
        while i < len(units) and self.pointers.states[units[i]] is not Unit.PENDING:
            i += 1
        self._cursor[channel] = i
        return units[i] if i < len(units) else None

    def claim_compute(self, unit: int) -> None:
        was = self.pointers.states[unit]
        self.pointers.claim_compute(unit)
        self._claimed(unit, was)

    def claim_load(self, unit: int) -> None:
        self.pointers.claim_load(unit)
        self._claimed(unit, Unit.PENDING)

    def load_missed(self, unit: int) -> None:
        self.pointers.missed(unit)
        self.open_s += self.plan.compute_s[unit]

    def lose_channel(self, channel: int) -> None:
        """Storage behind `channel` is gone: its pending and in-flight units become compute work."""
        for unit in self._by_channel.pop(channel, []):
            state = self.pointers.states[unit]
            if state is Unit.PENDING:
                self.pointers.missed(unit)
                self._pending_on[channel] -= 1
            elif state is Unit.LOADING:
                self.load_missed(unit)

    def _claimed(self, unit: int, was: Unit) -> None:
        if was in OPEN:
            self.open_s -= self.plan.compute_s[unit]
        if was is Unit.PENDING:
            self._pending_on[self.plan.load_channel[unit]] -= 1


class RequestWork:
    """One request's restore on every stage, as a policy sees it (`LoadCandidate`)."""

    def __init__(self, plan: RequestPlan, *, order: int, policy: Policy) -> None:
        self.plan = plan
        self.order = order
        self.policy = policy
        self.pending_on: Counter[int] = Counter()  # channel -> PENDING units it holds, over all stages
        self.stages = [StageWork(s, token_mode=plan.mode == "token", pending_on=self.pending_on)
                       for s in plan.stages]
        self.total_s = sum(sum(s.compute_s) for s in plan.stages)  # predicted compute seconds of all its units

    @property
    def request_id(self) -> str:
        return self.plan.request_id

    @property
    def arrival_s(self) -> float:
        return self.plan.arrival_s

    @property
    def remaining_s(self) -> float:
        """Predicted compute seconds of everything not yet restored nor being restored."""
        return max(0.0, sum(s.open_s for s in self.stages))

    def complete(self) -> bool:
        return all(s.pointers.complete() for s in self.stages)

    def loads_from(self, channel: int) -> bool:
        """Would `channel` serve this request now: its policy loads and the channel holds a PENDING unit of it."""
        return self.policy.loads and self.pending_on[channel] > 0
