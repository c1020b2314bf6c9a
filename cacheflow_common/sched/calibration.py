"""What the scheduler has learned from measurements: how much slower loads run than predicted, and how
long each stage's compute step takes.

Predictions come from a cost model profiled once; the machine that runs them drifts (other tenants,
thermal limits, a busier link). The meeting point compares predicted load seconds with measured step
seconds, so both are corrected here, in one place, with one weight.
"""

from __future__ import annotations

from cacheflow_common.sched.loads import InFlightLoad
from cacheflow_common.sched.work import StageWork

# How fast calibration follows measurements: 0.3 tracks a machine whose speed drifts without chasing
# one noisy load or step.
CALIBRATION_WEIGHT = 0.3
# A process's first compute measured this much slower than predicted is taken for its warm-up (kernels, metadata
# builders: 2-3 s for a planned front at TP 2 on CPU, against tenths of a second after), not learnt from.
WARM_UP_RATIO = 3.0


class Calibration:
    """Measured / predicted load time (one scale for every channel) and each stage's measured step time; for
    restores planned before they start (the connector's `planned_split.py`), measured / predicted compute time."""

    def __init__(self) -> None:
        self.load_scale = 1.0  # measured / predicted load time
        self.compute_scale = 1.0  # measured / predicted compute time (planned restores)
        self._compute_seen = False  # whether compute_scale holds a measurement yet
        self._compute_warm = False  # whether compute was measured at all (the first may be a warm-up)
        self._step_s: dict[int, float] = {}  # stage -> measured seconds per compute step (moving average)

    def load_landed(self, load: InFlightLoad, now: float | None) -> None:
        """`load` landed at `now` (None: the caller keeps no clock, nothing is learned)."""
        if now is not None and load.predicted_s > 0:  # its prediction was calibrated: undo that
            self.load_scale = _moved(self.load_scale, (now - load.started_s) / load.predicted_s * self.load_scale)

    def loads_measured(self, predicted_s: float, measured_s: float) -> None:
        """Loads the cost model predicted (uncalibrated) would take `predicted_s` took `measured_s`."""
        if predicted_s > 0:
            self.load_scale = _moved(self.load_scale, measured_s / predicted_s)

    def compute_measured(self, predicted_s: float, measured_s: float) -> None:
        """Compute the cost model predicted (uncalibrated) would take `predicted_s` took `measured_s`. The first
        measurement is taken as it is (as `step_done`'s first step): one comes per step of fronts, too few for
        a moving average to leave its prior soon; loads, measured per chunk, leave it within one restore. The
        process's very first is not learnt from if it took over `WARM_UP_RATIO` times its calibrated prediction."""
        if predicted_s <= 0:
            return
        warming_up = not self._compute_warm and measured_s > WARM_UP_RATIO * predicted_s * self.compute_scale
        self._compute_warm = True
        if not warming_up:
            scale = measured_s / predicted_s
            self.compute_scale = _moved(self.compute_scale, scale) if self._compute_seen else scale
            self._compute_seen = True

    def step_done(self, stage: int, seconds: float) -> None:
        """A compute step of `stage` took `seconds`: what the next one is expected to take."""
        previous = self._step_s.get(stage)
        self._step_s[stage] = seconds if previous is None else previous + CALIBRATION_WEIGHT * (seconds - previous)

    def step_s(self, stage: int) -> float | None:
        """The expected seconds of `stage`'s next compute step; None before any was measured."""
        return self._step_s.get(stage)

    def load_s(self, work: StageWork, unit: int) -> float:
        """The predicted seconds to load `unit` of `work`, scaled by what loads have measured."""
        return work.plan.load_s[unit] * self.load_scale


def _moved(average: float, measured: float) -> float:
    """A moving average after one more measurement."""
    return average + CALIBRATION_WEIGHT * (measured - average)
