"""The two-pointer board: which restore units (token chunks or layers) are computed, which loaded.

The overlap protocol, as implemented here:

1. The compute side claims units from the front (`claim_compute`), the I/O side from the back
   (`claim_load`). Before each claim a `Planner` may decline it: it predicts where the two sides will
   meet from their busy times and the cost of the units still pending.
2. A unit is claimed exactly once; the pointers never cross. They meet where they actually meet.
3. A load that misses (absent, corrupt, unreachable) hands its unit back: it becomes `MISSED` and the
   compute side must compute it, after every unit below it is done.
4. In token mode the compute side skips units already loaded (chunk `k` needs only the KV of chunks
   `< k`). In layer mode it cannot: layer `l` needs the hidden state leaving layer `l - 1`, so the
   compute side walks contiguously from the bottom and stops once everything above it is loaded.
5. The restore is complete when every unit is `LOADED` or `COMPUTED`.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Protocol


class Unit(enum.Enum):
    PENDING = "pending"
    COMPUTING = "computing"
    LOADING = "loading"
    LOADED = "loaded"
    COMPUTED = "computed"
    MISSED = "missed"


_DONE = (Unit.LOADED, Unit.COMPUTED)
_WAIT = -1  # claim_compute: nothing to take yet, but loads in flight may still miss
# Every state change notifies the board's condition, so waits for events need no timeout; this is
# only a safety net. Re-planning waits never sleep less than _MIN_REPLAN_S: a tighter loop would take
# the GIL from the compute thread often enough to slow the forward pass.
_EVENT_WAIT_S = 1.0
_MIN_REPLAN_S = 0.005


@dataclass(frozen=True)
class BoardView:
    """What a planner sees at a claim: the pending range and when each side becomes free."""

    pending: range  # contiguous: units between the two pointers
    now: float
    compute_free_at: float
    load_free_at: float
    load_active: bool


class Planner(Protocol):
    """Decides whether a side may take the next pending unit. Pure policy: no I/O, no compute.

    `replans_over_time`: whether a declined claim may be granted later without any event (because
    time passing changes the prediction). If not, a declined side sleeps until the next event.
    """

    replans_over_time: bool

    def compute_may_take(self, view: BoardView) -> bool: ...

    def load_may_take(self, view: BoardView) -> bool: ...

    def observe(self, unit: int, side: str, seconds: float) -> None: ...

    def predicted_s(self, unit: int, side: str) -> float: ...


@dataclass
class UnitRecord:
    """How one unit was restored: by which side, when (seconds since the board started), why it missed."""

    source: str = ""  # "computed" | "loaded"
    start_s: float = 0.0
    end_s: float = 0.0
    miss_reason: str = ""


class TwoPointerBoard:
    """Thread-safe claim board for `n` units shared by one compute thread and one loader thread."""

    def __init__(self, n: int, *, planner: Planner, compute_skips_loaded: bool) -> None:
        self.n = n
        self.planner = planner
        self.compute_skips_loaded = compute_skips_loaded
        self.states = [Unit.PENDING] * n
        self.records = [UnitRecord() for _ in range(n)]
        self.t0 = time.perf_counter()
        self._cond = threading.Condition()
        self._compute_front = 0  # layer mode: next layer the compute side must pass through
        self._compute_free_at = self.t0
        self._load_free_at = self.t0
        self._load_active = True

    # -- the compute side ---------------------------------------------------------------------
    def claim_compute(self) -> int | None:
        """The next unit to compute, blocking while the loader may still cover it; None when done."""
        with self._cond:
            while True:
                unit = self._compute_candidate()
                if unit is None:
                    return None
                if unit == _WAIT:
                    self._cond.wait(timeout=_EVENT_WAIT_S)
                    continue
                if self.states[unit] is Unit.PENDING:
                    if not self.planner.compute_may_take(self._view()):
                        self._cond.wait(timeout=self._replan_wait_s(self._load_free_at))
                        continue
                elif not self._ready_for_fallback(unit):
                    self._cond.wait(timeout=_EVENT_WAIT_S)
                    continue
                self._start(unit, Unit.COMPUTING)
                self._compute_free_at = time.perf_counter() + self.planner.predicted_s(unit, "compute")
                return unit

    def _compute_candidate(self) -> int | None:
        """The unit the compute side would take next, `_WAIT` if it must wait, None if it is done."""
        if self.compute_skips_loaded:
            for i, s in enumerate(self.states):
                if s in (Unit.PENDING, Unit.MISSED):
                    return i
            return _WAIT if Unit.LOADING in self.states else None
        # Layer mode: walk contiguously; pass through loaded layers only to reach a missed one above.
        rest = self.states[self._compute_front :]
        if not rest or all(s in _DONE for s in rest):
            return None
        if rest[0] in (Unit.PENDING, Unit.MISSED) or Unit.MISSED in rest:
            return self._compute_front
        return _WAIT  # only loads in flight above: wait for them to land (or miss)

    def _lower_units_done(self, unit: int) -> bool:
        if not self.compute_skips_loaded:
            return True  # layer mode: the front itself is the dependency
        return all(s in _DONE for s in self.states[:unit])

    def _ready_for_fallback(self, unit: int) -> bool:
        """A missed unit (token mode) or a loaded one we must pass through (layer mode) may start now."""
        if self.states[unit] is Unit.LOADING:
            return False  # never overwrite a buffer the loader is writing
        return self._lower_units_done(unit)

    def compute_done(self, unit: int) -> None:
        with self._cond:
            seconds = self._finish(unit, Unit.COMPUTED, "computed")
            self._compute_front = max(self._compute_front, unit + 1)
            self._compute_free_at = time.perf_counter()
            self.planner.observe(unit, "compute", seconds)
            self._cond.notify_all()

    # -- the I/O side --------------------------------------------------------------------------
    def claim_load(self) -> int | None:
        """The next unit to load (highest pending), or None once nothing is left for the loader.

        When the planner says compute should take the rest, the loader waits and re-plans at the next
        event (its predictions improve as units finish) instead of giving up for good.
        """
        with self._cond:
            while self._load_active:
                pending = self._pending()
                if not pending:
                    self._retire_loader()
                    return None
                if self.planner.load_may_take(self._view()):
                    unit = pending[-1]
                    self._start(unit, Unit.LOADING)
                    self._load_free_at = time.perf_counter() + self.planner.predicted_s(unit, "load")
                    return unit
                self._cond.wait(timeout=self._replan_wait_s(self._compute_free_at))
            return None

    def load_done(self, unit: int) -> None:
        with self._cond:
            seconds = self._finish(unit, Unit.LOADED, "loaded")
            self._load_free_at = time.perf_counter()
            self.planner.observe(unit, "load", seconds)
            self._cond.notify_all()

    def load_missed(self, unit: int, reason: str) -> None:
        """The load of `unit` failed: hand it back to the compute side."""
        with self._cond:
            self.states[unit] = Unit.MISSED
            self.records[unit].miss_reason = reason
            self._load_free_at = time.perf_counter()
            self._cond.notify_all()

    def abort_loader(self, reason: str) -> None:
        """The loader died: whatever it held goes back to compute; it claims nothing more."""
        with self._cond:
            for i, s in enumerate(self.states):
                if s is Unit.LOADING:
                    self.states[i] = Unit.MISSED
                    self.records[i].miss_reason = reason
            self._retire_loader()

    # -- shared ----------------------------------------------------------------------------
    def _retire_loader(self) -> None:
        self._load_active = False
        self._cond.notify_all()

    def _pending(self) -> range:
        """The contiguous run of PENDING units between the pointers (empty if none)."""
        idx = [i for i, s in enumerate(self.states) if s is Unit.PENDING]
        return range(idx[0], idx[-1] + 1) if idx else range(0)

    def _view(self) -> BoardView:
        return BoardView(
            pending=self._pending(),
            now=time.perf_counter(),
            compute_free_at=self._compute_free_at,
            load_free_at=self._load_free_at,
            load_active=self._load_active,
        )

    def _replan_wait_s(self, other_side_free_at: float) -> float:
        """How long a declined side sleeps: until the next event, or when the other side should be free."""
        if not self.planner.replans_over_time:
            return _EVENT_WAIT_S
        return min(_EVENT_WAIT_S, max(_MIN_REPLAN_S, other_side_free_at - time.perf_counter()))

    def _start(self, unit: int, state: Unit) -> None:
        self.states[unit] = state
        self.records[unit].start_s = time.perf_counter() - self.t0

    def _finish(self, unit: int, state: Unit, source: str) -> float:
        self.states[unit] = state
        rec = self.records[unit]
        rec.source = source
        rec.end_s = time.perf_counter() - self.t0
        return rec.end_s - rec.start_s

    def wake(self) -> None:
        """Make waiting claims re-check now: something a planner looks at outside the board changed."""
        with self._cond:
            self._cond.notify_all()

    def complete(self) -> bool:
        with self._cond:
            return all(s in _DONE for s in self.states)
