"""The scheduler's bookkeeping for one request: its two pointers on every stage, plus what ranking,
channel choice and the meeting point need fast, kept up to date as units change state instead of
recounted per decision: open compute cost, PENDING units and their exact load seconds per channel, the
highest PENDING unit per channel and the lowest PENDING unit.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter

from cacheflow_common.restore.pointers import OPEN, TwoPointers, Unit
from cacheflow_common.sched.exact import exact
from cacheflow_common.sched.plan import NOT_STORED, RequestPlan, StagePlan
from cacheflow_common.sched.policies import Policy


class StageWork:
    """One request's restore on one stage: the pointer state machine, annotated with the plan's costs."""

    def __init__(self, plan: StagePlan, *, token_mode: bool, pending_on: Counter[int],
                 pending_load: Counter[int]) -> None:
        self.plan = plan
        self.pointers = TwoPointers(plan.n_units, compute_skips_loaded=token_mode)
        self.open_s = sum(plan.compute_s)  # predicted compute seconds of units nobody restored or claimed
        # Shared by the request's stages, per channel: its PENDING units, and their predicted load seconds (exact).
        self._pending_on = pending_on
        self._pending_load = pending_load
        self._load = tuple(exact(s) for s in plan.load_s)  # each unit's predicted load seconds, exact
        self._held: dict[int, list[int]] = {}  # channel -> the units it holds, lowest first
        self._held_load: dict[int, list[int]] = {}  # channel -> exact load of its lowest i units, for every i
        self._pending_here: Counter[int] = Counter()  # channel -> PENDING units of this stage
        for unit, channel in enumerate(plan.load_channel):
            if channel == NOT_STORED:
                self.pointers.missed(unit)
                continue
            self._held.setdefault(channel, []).append(unit)
            below = self._held_load.setdefault(channel, [0])
            below.append(below[-1] + self._load[unit])
            self._pending_here[channel] += 1
            pending_on[channel] += 1
            pending_load[channel] += self._load[unit]
        self._by_channel = {channel: units[::-1] for channel, units in self._held.items()}  # highest first
        self._cursor: dict[int, int] = {}  # channel -> index in _by_channel of its highest PENDING unit
        self._lowest = 0  # no unit below this one is PENDING (units never return to PENDING)
        self._highest = plan.n_units - 1  # nor above this one

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

    def pending_channels(self) -> list[int]:
        """The channels holding a PENDING unit of this stage."""
        return [channel for channel, n in self._pending_here.items() if n > 0]

    def whole_pending_span(self) -> range | None:
        """The units from the lowest PENDING one to the highest, if every one of them is PENDING; else None
        (no unit is PENDING, or one between them is taken, restored or missed)."""
        count = self.pointers.count(Unit.PENDING)
        if not count:
            return None
        states = self.pointers.states
        while states[self._lowest] is not Unit.PENDING:
            self._lowest += 1
        while states[self._highest] is not Unit.PENDING:
            self._highest -= 1
        return range(self._lowest, self._highest + 1) if self._highest - self._lowest + 1 == count else None

    def exact_load(self, unit: int) -> int:
        """The unit's predicted load seconds, exact (`exact`)."""
        return self._load[unit]

    def load_between(self, channel: int, start: int, end: int) -> int:
        """Exact predicted load seconds of the units in [start, end) that `channel` holds, whatever their state."""
        held, below = self._held[channel], self._held_load[channel]
        return below[bisect_left(held, end)] - below[bisect_left(held, start)]

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
        self._held.pop(channel, None)
        self._held_load.pop(channel, None)
        for unit in self._by_channel.pop(channel, []):
            state = self.pointers.states[unit]
            if state is Unit.PENDING:
                self.pointers.missed(unit)
                self._pending_here[channel] -= 1
                self._pending_on[channel] -= 1
                self._pending_load[channel] -= self._load[unit]
            elif state is Unit.LOADING:
                self.load_missed(unit)

    def _claimed(self, unit: int, was: Unit) -> None:
        if was in OPEN:
            self.open_s -= self.plan.compute_s[unit]
        if was is Unit.PENDING:
            channel = self.plan.load_channel[unit]
            self._pending_here[channel] -= 1
            self._pending_on[channel] -= 1
            self._pending_load[channel] -= self._load[unit]


class RequestWork:
    """One request's restore on every stage, as a policy sees it (`LoadCandidate`)."""

    def __init__(self, plan: RequestPlan, *, order: int, policy: Policy) -> None:
        self.plan = plan
        self.order = order
        self.policy = policy
        self.pending_on: Counter[int] = Counter()  # channel -> PENDING units it holds, over all stages
        self.pending_load: Counter[int] = Counter()  # channel -> their predicted load seconds, exact (`exact`)
        self.stages = [StageWork(s, token_mode=plan.mode == "token", pending_on=self.pending_on,
                                 pending_load=self.pending_load) for s in plan.stages]
        self.total_s = sum(sum(s.compute_s) for s in plan.stages)  # predicted compute seconds of all its units
        # the fewest tokens any of its units computes (a step's budget below it fits none of them)
        self.smallest_unit = min((t for s in plan.stages for t in s.tokens), default=0)

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
