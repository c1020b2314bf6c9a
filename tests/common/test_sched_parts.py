"""The batch scheduler's parts on their own: the calibration's moving averages and the loads in flight."""

from __future__ import annotations

import pytest

from cacheflow_common.sched.calibration import CALIBRATION_WEIGHT, WARM_UP_RATIO, Calibration
from cacheflow_common.sched.loads import InFlightLoad, LoadsInFlight
from cacheflow_common.sched.tasks import LoadTask


def test_a_load_landing_without_a_clock_teaches_nothing():
    calibration = Calibration()
    calibration.load_landed(InFlightLoad(channel=0, started_s=0.0, predicted_s=1.0), None)
    calibration.load_landed(InFlightLoad(channel=0, started_s=0.0, predicted_s=0.0), 5.0)  # nothing predicted
    assert calibration.load_scale == 1.0


def test_loads_slower_than_predicted_scale_later_predictions_up_by_the_weight():
    calibration = Calibration()
    calibration.load_landed(InFlightLoad(channel=0, started_s=1.0, predicted_s=1.0), 3.0)  # took 2x
    assert calibration.load_scale == pytest.approx(1 + CALIBRATION_WEIGHT)

    calibration.load_landed(InFlightLoad(channel=0, started_s=0.0, predicted_s=1 + CALIBRATION_WEIGHT), 2.0)
    scale = 1 + CALIBRATION_WEIGHT
    assert calibration.load_scale == pytest.approx(scale + CALIBRATION_WEIGHT * (2 - scale))  # 2x its uncalibrated 1 s


def test_loads_and_compute_measured_against_uncalibrated_predictions_teach_their_own_scales():
    calibration = Calibration()
    calibration.loads_measured(0.0, 5.0)  # nothing predicted: nothing learned
    calibration.compute_measured(0.0, 5.0)
    calibration.loads_measured(1.0, 2.0)
    calibration.loads_measured(1.0, 2.0)
    calibration.compute_measured(2.0, 1.0)
    scale = 1 + CALIBRATION_WEIGHT
    assert calibration.load_scale == pytest.approx(scale + CALIBRATION_WEIGHT * (2 - scale))
    assert calibration.compute_scale == pytest.approx(0.5)  # the first compute measured, as it is (one per step)
    calibration.compute_measured(1.0, 1.5)
    assert calibration.compute_scale == pytest.approx(0.5 + CALIBRATION_WEIGHT * (1.5 - 0.5))


def test_a_first_compute_far_slower_than_predicted_is_a_warm_up_not_learnt_from():
    calibration = Calibration()
    calibration.compute_measured(1.0, WARM_UP_RATIO + 1)  # the process's first: its warm-up
    assert calibration.compute_scale == 1.0
    calibration.compute_measured(1.0, WARM_UP_RATIO + 1)  # a second as slow is what compute takes
    assert calibration.compute_scale == pytest.approx(WARM_UP_RATIO + 1)


def test_the_first_step_is_taken_as_measured_then_averaged():
    calibration = Calibration()
    assert calibration.step_s(0) is None
    calibration.step_done(0, 2.0)
    calibration.step_done(0, 1.0)
    assert calibration.step_s(0) == pytest.approx(2.0 - CALIBRATION_WEIGHT) and calibration.step_s(1) is None


def test_loads_of_a_lost_channel_or_failed_request_are_no_longer_tracked():
    loads = LoadsInFlight()
    for started, (task, channel) in enumerate(((LoadTask("a", 0, 1), 0), (LoadTask("b", 0, 1), 0),
                                               (LoadTask("a", 0, 2), 1))):
        loads.start(task, InFlightLoad(channel, float(started), 1.0))
    assert loads.busy_on({0, 2}) == {0: InFlightLoad(0, 1.0, 1.0)}  # the latest started on channel 0
    loads.drop_channel(1)
    assert loads.end(LoadTask("a", 0, 2)) is None
    loads.drop_request("a")
    assert loads.end(LoadTask("a", 0, 1)) is None and loads.end(LoadTask("b", 0, 1)) is not None
