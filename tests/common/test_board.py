"""The fixed-split board of the baseline runner, without a model: claims, misses, meeting; and the best split."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from cacheflow_common.restore.board import TwoPointerBoard
from cacheflow_common.restore.costs import best_split, best_split_from, earliest_split, earliest_split_computes


def _drive(board: TwoPointerBoard, misses: set[int], seed: int) -> tuple[list[int], list[int]]:
    """Run a compute thread and a loader thread on `board`; returns the units each side finished."""
    rng = random.Random(seed)
    delays = [rng.uniform(0, 0.002) for _ in range(2 * board.n)]
    computed: list[int] = []
    loaded: list[int] = []

    def loader() -> None:
        while (u := board.claim_load()) is not None:
            time.sleep(delays[board.n + u])
            if u in misses:
                board.load_missed(u, "absent")
            else:
                loaded.append(u)
                board.load_done(u)

    t = threading.Thread(target=loader)
    t.start()
    while (u := board.claim_compute()) is not None:
        time.sleep(delays[u])
        computed.append(u)
        board.compute_done(u)
    t.join()
    return computed, loaded


def _check_partition(board: TwoPointerBoard, computed: list[int], loaded: list[int], token_mode: bool) -> None:
    assert board.complete()
    assert sorted(set(computed) | set(loaded)) == list(range(board.n))
    assert len(loaded) == len(set(loaded))
    if token_mode:
        # Every unit restored exactly once; the compute pointer walks upward.
        assert len(computed) == len(set(computed)) and not set(computed) & set(loaded)
        assert computed == sorted(computed)
    else:
        # Layer mode computes a contiguous run from the bottom (passing loaded layers only to reach a miss).
        assert computed == list(range(len(computed)))
    for u, rec in enumerate(board.records()):
        assert rec.source == ("computed" if u in computed else "loaded")


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    miss_bits=st.integers(0, 2**12 - 1),
    token_mode=st.booleans(),
    split_at=st.floats(0, 1),
    seed=st.integers(0, 1000),
)
def test_every_unit_restored_once_and_pointers_never_cross(n, miss_bits, token_mode, split_at, seed):
    misses = {u for u in range(n) if miss_bits >> u & 1}
    board = TwoPointerBoard(n, split=round(split_at * n), compute_skips_loaded=token_mode)
    computed, loaded = _drive(board, misses, seed)
    _check_partition(board, computed, loaded, token_mode)
    assert not set(loaded) & misses
    if token_mode and misses:
        assert misses <= set(computed)


def test_fixed_split_is_exact():
    board = TwoPointerBoard(6, split=2, compute_skips_loaded=True)
    computed, loaded = _drive(board, set(), 0)
    assert computed == [0, 1] and sorted(loaded) == [2, 3, 4, 5]


def test_layer_mode_passes_through_loaded_layers_to_reach_a_miss():
    board = TwoPointerBoard(5, split=0, compute_skips_loaded=False)
    computed, loaded = _drive(board, {3}, 0)
    assert computed == [0, 1, 2, 3] and sorted(loaded) == [0, 1, 2, 4]
    assert [r.source for r in board.records()] == ["computed"] * 4 + ["loaded"]


@given(st.lists(st.floats(0, 10), min_size=0, max_size=10), st.data())
def test_best_split_matches_brute_force(compute, data):
    load = data.draw(st.lists(st.floats(0, 10), min_size=len(compute), max_size=len(compute)))
    k, t = best_split(compute, load)
    brute = min(max(sum(compute[:j]), sum(load[j:])) for j in range(len(compute) + 1))
    assert abs(t - brute) < 1e-9 and abs(max(sum(compute[:k]), sum(load[k:])) - t) < 1e-9


def test_best_split_accounts_for_busy_sides():
    # Compute is busy for 10 s: everything should be loaded.
    assert best_split_from([1, 1, 1], [1, 1, 1], compute_ready_s=10, load_ready_s=0)[0] == 0
    # The loader is busy for 10 s: everything should be computed.
    assert best_split_from([1, 1, 1], [1, 1, 1], compute_ready_s=0, load_ready_s=10)[0] == 3


def _monotone_ends(data: st.DataObject) -> tuple[int, Callable[[int], int], Callable[[int], int]]:
    """A split problem as the meeting point poses it: compute one whole step per unit, and each of a few
    channels busy for a while, then loading its units from the top down (small integers: many ties)."""
    n = data.draw(st.integers(0, 8))
    step = data.draw(st.integers(0, 4))
    channels = data.draw(st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(0, 3), min_size=n,
                                                                          max_size=n)), min_size=1, max_size=3))

    def load_end(k: int) -> int:
        return max(busy + sum(loads[k:]) for busy, loads in channels)

    return n, lambda k: k * step, load_end


@given(st.data())
def test_the_earliest_split_is_the_lowest_that_ends_first(data):
    n, compute_end, load_end = _monotone_ends(data)
    ends = [max(compute_end(k), load_end(k)) for k in range(n + 1)]
    assert earliest_split(n, compute_end, load_end) == (ends.index(min(ends)), min(ends))
    assert earliest_split_computes(n, compute_end, load_end) == (ends.index(min(ends)) > 0)
