"""The pure two-pointer state machine: the rules the board and the batch scheduler share."""

from __future__ import annotations

import pytest

from cacheflow_common.restore.pointers import WAIT, InvalidTransitionError, TwoPointers, Unit


def test_token_mode_skips_loaded_units_and_meets_in_the_middle():
    p = TwoPointers(4, compute_skips_loaded=True)
    p.claim_load(3)
    assert p.next_compute() == 0
    p.claim_compute(0)
    assert p.next_compute() == WAIT  # one unit computes at a time
    p.computed(0)
    p.loaded(3)
    p.claim_load(2)
    p.claim_compute(1)
    p.computed(1)
    assert p.next_compute() == WAIT  # unit 2 is landing: wait for it (or its miss)
    p.loaded(2)
    assert p.next_compute() is None and p.complete()


def test_token_mode_waits_for_a_lower_load_still_landing():
    # Two channels: unit 1 is loading while unit 3 was loaded; unit 2 must wait for unit 1.
    p = TwoPointers(4, compute_skips_loaded=True)
    p.claim_load(3)
    p.claim_load(1)
    p.loaded(3)
    p.claim_compute(0)
    p.computed(0)
    assert p.next_compute() == WAIT
    p.loaded(1)
    assert p.next_compute() == 2


def test_missed_unit_is_computed_after_every_unit_below_it():
    p = TwoPointers(3, compute_skips_loaded=True)
    p.claim_load(2)
    p.claim_load(1)
    p.missed(2)  # e.g. absent
    p.claim_compute(0)
    p.computed(0)
    assert p.next_compute() == WAIT  # unit 1 still landing below the missed unit 2
    p.loaded(1)
    assert p.next_compute() == 2
    p.claim_compute(2)
    p.computed(2)
    assert p.complete() and [s.value for s in p.states] == ["computed", "loaded", "computed"]


def test_layer_mode_walks_contiguously_and_passes_through_loaded_layers_to_a_miss():
    p = TwoPointers(4, compute_skips_loaded=False)
    for layer in (3, 2, 1):
        p.claim_load(layer)
    p.loaded(1)
    p.missed(2)
    p.loaded(3)
    order = []
    while (unit := p.next_compute()) not in (None, WAIT):
        assert unit is not None
        p.claim_compute(unit)
        p.computed(unit)
        order.append(unit)
    assert order == [0, 1, 2] and p.complete()
    assert p.states[3] is Unit.LOADED


def test_layer_mode_stops_below_loaded_layers():
    p = TwoPointers(3, compute_skips_loaded=False)
    p.claim_load(2)
    p.claim_compute(0)
    p.computed(0)
    p.claim_load(1)
    assert p.next_compute() == WAIT
    p.loaded(1)
    p.loaded(2)
    assert p.next_compute() is None and p.complete()


def test_protocol_violations_raise():
    p = TwoPointers(3, compute_skips_loaded=True)
    with pytest.raises(InvalidTransitionError):
        p.claim_compute(1)  # not the compute pointer's unit
    with pytest.raises(InvalidTransitionError):
        p.loaded(2)  # never claimed
    p.claim_load(2)
    with pytest.raises(InvalidTransitionError):
        p.claim_load(2)  # claimed twice
    with pytest.raises(InvalidTransitionError):
        p.computed(0)
    assert p.abort_loads() == [2] and p.states[2] is Unit.MISSED
