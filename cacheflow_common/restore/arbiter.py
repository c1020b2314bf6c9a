"""One stage's storage links, shared by the requests restoring on it at once: which request loads next.

The I/O side of the batch-aware schedule (DESIGN.md §1, the paper's Algorithm 1) on a real worker:
each restore's loader asks for a slot before every load; `slots` is the number of storage pods (each
serving one load at a time, as the simulator's channels). A freed slot goes to the waiting request
with the largest remaining recomputation cost (the units neither pointer has claimed yet, in
token-layers: where one more load saves the most compute), re-evaluated at every grant. Under the
per-request baselines (Cake, load-only) slots go in arrival order instead. Policies are not meant to
be mixed on one stage at once; if they are, CacheFlow's requests are served first.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

from cacheflow_common.errors import ConfigError

POLL_S = 0.01  # a waiting loader re-checks this often: remaining costs change without a signal


class LoadArbiter:
    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ConfigError(f"a load arbiter needs at least one slot, got {slots}")
        self.slots = slots
        self._free = slots
        self._waiting: set[Lane] = set()
        self._cond = threading.Condition()
        self._arrivals = itertools.count()

    def lane(self, *, by_cost: bool, remaining_cost: Callable[[], float]) -> Lane:
        """A request's place at the links: ranked by `remaining_cost()` if `by_cost`, else by arrival."""
        return Lane(self, next(self._arrivals), by_cost, remaining_cost)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _best(self) -> Lane:
        return max(self._waiting, key=lambda lane: lane.rank())


class Lane:
    def __init__(self, arbiter: LoadArbiter, arrival: int, by_cost: bool, remaining_cost: Callable[[], float]) -> None:
        self.arbiter = arbiter
        self.arrival = arrival
        self.by_cost = by_cost
        self.remaining_cost = remaining_cost

    def rank(self) -> tuple[int, float]:
        return (1, self.remaining_cost()) if self.by_cost else (0, -self.arrival)

    def acquire(self, wanted: Callable[[], bool]) -> bool:
        """Block until this request gets a slot (True), or until `wanted()` turns False (False, no slot)."""
        a = self.arbiter
        with a._cond:
            a._waiting.add(self)
            try:
                while wanted():
                    if a._free > 0 and a._best() is self:
                        a._free -= 1
                        return True
                    a._cond.wait(timeout=POLL_S)
                return False
            finally:
                a._waiting.discard(self)
                a._cond.notify_all()

    def release(self) -> None:
        a = self.arbiter
        with a._cond:
            a._free += 1
            a._cond.notify_all()
