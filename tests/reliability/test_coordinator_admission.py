"""Admission says when no batch slot can free up: every slot held past a bound (its readiness and the
slot gauges come from here)."""

from __future__ import annotations

import pytest

from cacheflow_services.coordinator.admission import Admission, AdmissionTimeoutError
from tests.reliability.coordinator_checks import wait_for


def test_stuck_only_while_every_slot_is_held_past_the_bound():
    admission = Admission(max_batch=2, window_s=0.0, max_queue=4)
    try:
        assert admission.oldest_slot_age_s() == 0.0 and admission.stuck(0.0) == ""
        first, second = admission.enqueue(), admission.enqueue()
        assert admission.wait(first, 30) and admission.wait(second, 30)
        wait_for(lambda: admission.stuck(0.0) != "", "every slot held past a bound of 0 s")
        assert admission.stuck(0.0) == "all 2 batch slots have been held for more than 0 s"
        assert admission.stuck(3600.0) == ""  # held, but not past this bound
        assert admission.oldest_slot_age_s() > 0
        admission.done(first)
        admission.done(first)  # again: frees nothing more
        assert admission.running == 1 and admission.stuck(0.0) == ""  # a slot is free
        admission.done(second)
        assert admission.running == 0 and admission.oldest_slot_age_s() == 0.0
    finally:
        admission.close()


def test_a_lone_request_at_an_idle_cluster_does_not_wait_out_the_window():
    admission = Admission(max_batch=4, window_s=3600.0, max_queue=4)
    try:
        lone = admission.enqueue()
        assert admission.wait(lone, 30)  # admitted at once: the hour-long window is not waited out
        later = admission.enqueue()  # one is running: a batch window opens for those who come now
        with pytest.raises(AdmissionTimeoutError):
            admission.wait(later, 0.5)
        assert admission.waiting == 0 and admission.running == 1  # the timed-out one withdrew
    finally:
        admission.close()
