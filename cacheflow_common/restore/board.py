"""The two-pointer board: a compute thread and a loader thread share the claims of one restore.

The overlap protocol (the rules themselves live in `pointers.TwoPointers`; this board runs them
under a lock and adds timing and a planner):

1. The compute side claims units from the front (`claim_compute`), the I/O side from the back
   (`claim_load`). Before each claim of a pending unit a `Planner` may decline it: it predicts where
   the two sides will meet from their busy times and the cost of the units still pending.
2. A unit is claimed exactly once; the pointers never cross. They meet where they actually meet.
3. A load that misses (absent, corrupt, unreachable) hands its unit back: it becomes `MISSED` and the
   compute side must compute it, after every unit below it is done.
4. In token mode the compute side skips units already loaded (chunk `k` needs only the KV of chunks
   `< k`). In layer mode it cannot: layer `l` needs the hidden state leaving layer `l - 1`, so the
   compute side walks contiguously from the bottom and stops once everything above it is loaded.
5. The restore is complete when every unit is `LOADED` or `COMPUTED`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cacheflow_common.restore.pointers import WAIT, TwoPointers, Unit

__all__ = ["BoardView", "Planner", "TwoPointerBoard", "Unit", "UnitRecord"]

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
        self.pointers = TwoPointers(n, compute_skips_loaded=compute_skips_loaded)
        self.records = [UnitRecord() for _ in range(n)]
        self.t0 = time.perf_counter()
        self._cond = threading.Condition()
        self._compute_free_at = self.t0
        self._load_free_at = self.t0
        self._load_active = True

    @property
    def states(self) -> Sequence[Unit]:
        return self.pointers.states

    # -- the compute side ---------------------------------------------------------------------
    def claim_compute(self) -> int | None:
        """The next unit to compute, blocking while the loader may still cover it; None when done."""
        with self._cond:
            while True:
                unit = self.pointers.next_compute()
                if unit is None:
                    return None
                if unit == WAIT:
                    self._cond.wait(timeout=_EVENT_WAIT_S)
                    continue
                if self.states[unit] is Unit.PENDING and not self.planner.compute_may_take(self._view()):
                    self._cond.wait(timeout=self._replan_wait_s(self._load_free_at))
                    continue
                self.pointers.claim_compute(unit)
                self._started(unit)
                self._compute_free_at = time.perf_counter() + self.planner.predicted_s(unit, "compute")
                return unit

    def compute_done(self, unit: int) -> None:
        with self._cond:
            self.pointers.computed(unit)
            seconds = self._finished(unit, "computed")
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
                unit = self.pointers.highest_pending()
                if unit is None:
                    self._retire_loader()
                    return None
                if self.planner.load_may_take(self._view()):
                    self.pointers.claim_load(unit)
                    self._started(unit)
                    self._load_free_at = time.perf_counter() + self.planner.predicted_s(unit, "load")
                    return unit
                self._cond.wait(timeout=self._replan_wait_s(self._compute_free_at))
            return None

    def load_done(self, unit: int) -> None:
        with self._cond:
            self.pointers.loaded(unit)
            seconds = self._finished(unit, "loaded")
            self._load_free_at = time.perf_counter()
            self.planner.observe(unit, "load", seconds)
            self._cond.notify_all()

    def load_missed(self, unit: int, reason: str) -> None:
        """The load of `unit` failed: hand it back to the compute side."""
        with self._cond:
            self.pointers.missed(unit)
            self.records[unit].miss_reason = reason
            self._load_free_at = time.perf_counter()
            self._cond.notify_all()

    def abort_loader(self, reason: str) -> None:
        """The loader died: whatever it held goes back to compute; it claims nothing more."""
        with self._cond:
            for unit in self.pointers.abort_loads():
                self.records[unit].miss_reason = reason
            self._retire_loader()

    # -- shared ----------------------------------------------------------------------------
    def _retire_loader(self) -> None:
        self._load_active = False
        self._cond.notify_all()

    def _view(self) -> BoardView:
        return BoardView(
            pending=self.pointers.pending_span(),
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

    def _started(self, unit: int) -> None:
        self.records[unit].start_s = time.perf_counter() - self.t0

    def _finished(self, unit: int, source: str) -> float:
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
            return self.pointers.complete()
