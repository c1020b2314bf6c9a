"""Planners: the policy that decides, at each claim, whether a side may take the next pending unit.

* `GreedyPlanner` — both sides take whatever is next until they meet (Cake's two pointers).
* `FixedSplitPlanner` — units `< k` are computed, `>= k` loaded (compute-only is `k = n`, load-only
  is `k = 0`); misses are still computed.
* `PredictivePlanner` — CacheFlow: at every claim it re-plans the meeting point of the units still
  pending from the two sides' real busy times and per-unit cost predictions, which it recalibrates
  online from the units finished so far (measured / predicted). This removes most of the idle time
  greedy claiming leaves at the meeting point (the last unit in flight on the slower side).
"""

from __future__ import annotations

from collections.abc import Sequence

from cacheflow_common.restore.board import BoardView
from cacheflow_common.restore.costs import best_split_from

# How fast the online calibration follows new measurements: 0.5 trusts the newest unit as much as
# all history, which tracks a machine whose speed changes mid-restore without chasing single outliers.
_CALIBRATION_WEIGHT = 0.5


class GreedyPlanner:
    """Cake: every claim is granted."""

    replans_over_time = False

    def compute_may_take(self, view: BoardView) -> bool:
        return True

    def load_may_take(self, view: BoardView) -> bool:
        return True

    def observe(self, unit: int, side: str, seconds: float) -> None:
        return None

    def predicted_s(self, unit: int, side: str) -> float:
        return 0.0


class FixedSplitPlanner(GreedyPlanner):
    """Units below `split` are computed, the rest loaded."""

    def __init__(self, split: int) -> None:
        self.split = split

    def compute_may_take(self, view: BoardView) -> bool:
        return view.pending.start < self.split or not view.load_active

    def load_may_take(self, view: BoardView) -> bool:
        return view.pending.stop - 1 >= self.split


class PredictivePlanner:
    """CacheFlow: re-plan the meeting point at every claim, with online-calibrated unit costs."""

    replans_over_time = True

    def __init__(self, compute_s: Sequence[float], load_s: Sequence[float]) -> None:
        if len(compute_s) != len(load_s):
            raise ValueError("compute and load cost lists differ in length")
        self._compute_s = list(compute_s)
        self._load_s = list(load_s)
        self._scale = {"compute": 1.0, "load": 1.0}

    def predicted_s(self, unit: int, side: str) -> float:
        base = self._compute_s[unit] if side == "compute" else self._load_s[unit]
        return base * self._scale[side]

    def observe(self, unit: int, side: str, seconds: float) -> None:
        predicted = self._compute_s[unit] if side == "compute" else self._load_s[unit]
        if predicted > 0 and seconds > 0:
            w = _CALIBRATION_WEIGHT
            self._scale[side] = (1 - w) * self._scale[side] + w * (seconds / predicted)

    def _split(self, view: BoardView) -> int:
        """Where the pending units should be cut: `< split` computed, `>= split` loaded."""
        units = view.pending
        compute = [self.predicted_s(u, "compute") for u in units]
        load = [self.predicted_s(u, "load") for u in units]
        k, _ = best_split_from(
            compute,
            load,
            compute_ready_s=max(0.0, view.compute_free_at - view.now),
            load_ready_s=max(0.0, view.load_free_at - view.now),
        )
        return units.start + k

    def compute_may_take(self, view: BoardView) -> bool:
        if not view.load_active or not view.pending:
            return True
        return self._split(view) > view.pending.start

    def load_may_take(self, view: BoardView) -> bool:
        if not view.pending:
            return False
        return self._split(view) <= view.pending.stop - 1
