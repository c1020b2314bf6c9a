"""The fixed-split board of the benchmarks' baseline runner (`executor.run_fixed_split`): a compute
thread and loader threads share the claims of one restore, units below `split` computed and the rest
loaded. The engine (`cacheflow_common.engine`) runs every policy; this board only runs the baselines a
benchmark measures at their strongest (compute-only in any chunking, load-only with reads overlapped).

The overlap protocol (the rules themselves live in `pointers.TwoPointers`; this board runs them
under a lock and adds timing):

1. The compute side claims units from the front (`claim_compute`), the I/O side from the back
   (`claim_load`); compute takes pending units below `split` only (or any once no loader is left),
   the loader pending units from `split` up.
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

from cacheflow_common.restore.job import UnitLog, UnitRecord
from cacheflow_common.restore.pointers import WAIT, TwoPointers, Unit

__all__ = ["TwoPointerBoard", "Unit", "UnitRecord"]

# Every state change notifies the board's condition, so waits need no timeout; this is only a safety net.
_EVENT_WAIT_S = 1.0


class TwoPointerBoard:
    """Thread-safe claim board for `n` units: `< split` computed, `>= split` loaded (misses computed)."""

    def __init__(self, n: int, *, split: int, compute_skips_loaded: bool) -> None:
        self.n = n
        self.split = split
        self.compute_skips_loaded = compute_skips_loaded
        self.pointers = TwoPointers(n, compute_skips_loaded=compute_skips_loaded)
        self.log = UnitLog(n)  # times and miss reasons; which side restored a unit is its state in `pointers`
        self._cond = threading.Condition()
        self._load_active = True

    @property
    def states(self) -> Sequence[Unit]:
        return self.pointers.states

    def records(self) -> list[UnitRecord]:
        with self._cond:
            return self.log.records(self.pointers.states)

    # -- the compute side ---------------------------------------------------------------------
    def claim_compute(self) -> int | None:
        """The next unit to compute, blocking while the loader may still cover it; None when done."""
        with self._cond:
            while True:
                unit = self.pointers.next_compute()
                if unit is None:
                    return None
                pending = unit != WAIT and self.states[unit] is Unit.PENDING
                if unit == WAIT or (pending and unit >= self.split and self._load_active):
                    self._cond.wait(timeout=_EVENT_WAIT_S)
                    continue
                self.pointers.claim_compute(unit)
                self._started(unit)
                return unit

    def compute_done(self, unit: int) -> None:
        with self._cond:
            self.pointers.computed(unit)
            self.log.ended(unit, time.perf_counter())
            self._cond.notify_all()

    # -- the I/O side --------------------------------------------------------------------------
    def claim_load(self) -> int | None:
        """The next unit to load (highest pending at or above the split), or None once none is left."""
        with self._cond:
            if not self._load_active:
                return None
            unit = self.pointers.highest_pending()
            if unit is None or unit < self.split:
                self._retire_loader()
                return None
            self.pointers.claim_load(unit)
            self._started(unit)
            return unit

    def load_done(self, unit: int) -> None:
        with self._cond:
            self.pointers.loaded(unit)
            self.log.ended(unit, time.perf_counter())
            self._cond.notify_all()

    def load_missed(self, unit: int, reason: str) -> None:
        """The load of `unit` failed: hand it back to the compute side."""
        with self._cond:
            self.pointers.missed(unit)
            self.log.missed(unit, reason)
            self._cond.notify_all()

    def abort_loader(self, reason: str) -> None:
        """The loader died: whatever it held goes back to compute; it claims nothing more."""
        with self._cond:
            for unit in self.pointers.abort_loads():
                self.log.missed(unit, reason)
            self._retire_loader()

    # -- shared ----------------------------------------------------------------------------
    def _retire_loader(self) -> None:
        self._load_active = False
        self._cond.notify_all()

    def _started(self, unit: int) -> None:
        self.log.started(unit, time.perf_counter())

    def complete(self) -> bool:
        with self._cond:
            return self.pointers.complete()
