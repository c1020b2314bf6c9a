"""The two-pointer rules for one request on one stage, as a pure state machine: no threads, no clock.

Units are token chunks (token mode) or layers (layer mode). The rules, in one place:

1. The compute side takes units from the front (`next_compute`), the I/O side from the back
   (`highest_pending`). A unit is claimed exactly once; the pointers never cross, since a unit is in
   one state at a time and only a `PENDING` unit can be claimed for loading.
2. A load that misses (absent, corrupt, unreachable, never stored) hands its unit back: it becomes
   `MISSED` and the compute side computes it, once every unit below it is done.
3. In token mode the compute side skips units already loaded (chunk `k` needs only the KV of chunks
   `< k`), but starts a unit only when every unit below it is done (a load still landing there holds
   it back). In layer mode it cannot skip: layer `l` needs the hidden state leaving layer `l - 1`, so
   the compute side walks contiguously from the bottom, stops once everything above it is loaded, and
   passes through loaded layers only to reach a missed one above.
4. One unit computes at a time (each unit needs the ones below it).
5. The restore is complete when every unit is `LOADED` or `COMPUTED`.

`TwoPointerBoard` runs these rules under a lock for a compute thread and a loader thread; the batch
scheduler (`cacheflow_common.sched`) keeps one per (request, stage).

`TwoPointers` applies the rules; `UnitStates` is the table they read and write (with a count per state,
so "complete" and "anything loading" cost nothing), and the compute pointer's walk, which is all that
differs between the modes (rule 3), is `TokenFront` or `LayerFront`.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence

from cacheflow_common.errors import CacheFlowError


class Unit(enum.Enum):
    PENDING = "pending"
    COMPUTING = "computing"
    LOADING = "loading"
    LOADED = "loaded"
    COMPUTED = "computed"
    MISSED = "missed"


# Tuples, not sets: membership then compares identities, without hashing enum members (slow in 3.11).
DONE = (Unit.LOADED, Unit.COMPUTED)
OPEN = (Unit.PENDING, Unit.MISSED)  # not restored, and nobody is restoring it
WAIT = -1  # next_compute: nothing to take yet, but loads in flight may still land or miss


class InvalidTransitionError(CacheFlowError):
    """A caller broke the two-pointer protocol (claimed a unit it may not, finished one it never started)."""


class UnitStates:
    """The state of every unit, a count per state, and the transitions checked against the protocol."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.states = [Unit.PENDING] * n
        self._count: Counter[Unit] = Counter({Unit.PENDING: n})

    def count(self, state: Unit) -> int:
        return self._count[state]

    def all_done(self) -> bool:
        return self._count[Unit.LOADED] + self._count[Unit.COMPUTED] == self.n

    def move(self, unit: int, state: Unit) -> None:
        self._count[self.states[unit]] -= 1
        self._count[state] += 1
        self.states[unit] = state

    def expect(self, unit: int, state: Unit) -> None:
        if not 0 <= unit < self.n or self.states[unit] is not state:
            raise InvalidTransitionError(f"unit {unit} is not {state.value} ({self.describe(unit)})")

    def describe(self, unit: int) -> str:
        return self.states[unit].value if 0 <= unit < self.n else f"out of range 0..{self.n - 1}"

    def pending_span(self) -> range:
        """From the lowest to the highest PENDING unit (empty if none): what lies between the pointers."""
        idx = [i for i, s in enumerate(self.states) if s is Unit.PENDING]
        return range(idx[0], idx[-1] + 1) if idx else range(0)

    def highest_pending(self) -> int | None:
        for i in range(self.n - 1, -1, -1):
            if self.states[i] is Unit.PENDING:
                return i
        return None


class _ComputeFront:
    """The compute pointer: the unit the compute side would take next, and whether it may start it."""

    def __init__(self, units: UnitStates) -> None:
        self._units = units
        self.position = 0

    def candidate(self) -> int | None:
        """The unit the compute side would take next, `WAIT`, or None when it has nothing left."""
        raise NotImplementedError

    def may_start(self, unit: int) -> bool:
        if self._units.states[unit] is Unit.LOADING:
            return False  # never overwrite a buffer the loader is writing
        return unit == self.position  # token mode: every unit below is done; layer mode: always true

    def passed(self, unit: int) -> None:
        """`unit` was computed."""


class TokenFront(_ComputeFront):
    """Token mode: the front is the lowest unit not done yet (advanced lazily); loaded units are skipped."""

    def candidate(self) -> int | None:
        """The lowest unit neither loaded, computed nor in flight."""
        units, states = self._units, self._units.states
        while self.position < units.n and states[self.position] in DONE:
            self.position += 1
        for i in range(self.position, units.n):
            if states[i] in OPEN:
                return i
        return WAIT if units.count(Unit.LOADING) else None


class LayerFront(_ComputeFront):
    """Layer mode: the front is the next layer the compute side must pass through (no skipping)."""

    def candidate(self) -> int | None:
        """The front layer, while anything above it still needs computing; WAIT while only loads are left."""
        units = self._units
        if units.all_done():
            return None  # every layer below the front is computed, every one above loaded
        if units.states[self.position] in OPEN or units.count(Unit.MISSED):
            return self.position
        return WAIT

    def passed(self, unit: int) -> None:
        self.position = max(self.position, unit + 1)


class TwoPointers:
    """Unit states of one (request, stage) and the rules that move them."""

    def __init__(self, n: int, *, compute_skips_loaded: bool) -> None:
        self.n = n
        self.compute_skips_loaded = compute_skips_loaded  # True: token mode; False: layer mode
        self._units = UnitStates(n)
        self.states: Sequence[Unit] = self._units.states  # the state of every unit (a live view: do not modify)
        self._front = TokenFront(self._units) if compute_skips_loaded else LayerFront(self._units)

    def count(self, state: Unit) -> int:
        return self._units.count(state)

    def complete(self) -> bool:
        return self._units.all_done()

    # -- the compute side ---------------------------------------------------------------------
    def next_compute(self) -> int | None:
        """The unit the compute side may start now, `WAIT` if it must wait for an event, None if it is done."""
        if self._units.count(Unit.COMPUTING):
            return WAIT
        unit = self._front.candidate()
        if unit is None or unit == WAIT:
            return unit
        return unit if self._front.may_start(unit) else WAIT

    def claim_compute(self, unit: int) -> None:
        if unit < 0 or unit != self.next_compute():
            raise InvalidTransitionError(f"unit {unit} may not start computing now ({self._units.describe(unit)})")
        self._units.move(unit, Unit.COMPUTING)

    def computed(self, unit: int) -> None:
        self._units.expect(unit, Unit.COMPUTING)
        self._units.move(unit, Unit.COMPUTED)
        self._front.passed(unit)

    # -- the I/O side --------------------------------------------------------------------------
    def pending_span(self) -> range:
        return self._units.pending_span()

    def highest_pending(self) -> int | None:
        return self._units.highest_pending()

    def claim_load(self, unit: int) -> None:
        self._units.expect(unit, Unit.PENDING)
        self._units.move(unit, Unit.LOADING)

    def loaded(self, unit: int) -> None:
        self._units.expect(unit, Unit.LOADING)
        self._units.move(unit, Unit.LOADED)

    def missed(self, unit: int) -> None:
        """A load of `unit` failed, or can never happen (not stored, its storage lost): compute it instead."""
        if self.states[unit] not in (Unit.PENDING, Unit.LOADING):
            raise InvalidTransitionError(f"unit {unit} cannot miss: it is {self.states[unit].value}")
        self._units.move(unit, Unit.MISSED)

    def abort_loads(self) -> list[int]:
        """Every load in flight is handed back to compute; returns those units."""
        units = [i for i, s in enumerate(self.states) if s is Unit.LOADING]
        for unit in units:
            self._units.move(unit, Unit.MISSED)
        return units
