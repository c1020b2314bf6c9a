"""I/O threads leave the compute thread's cores (real threads, real affinity calls)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from cacheflow_common.restore.cores import move_off_compute_cores, parse_cpu_list, usable_cpus

T = TypeVar("T")


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-2,5\n") == {0, 1, 2, 5}
    assert parse_cpu_list("3") == {3}
    assert parse_cpu_list("") == set()


def in_thread(fn: Callable[[], T]) -> T:
    """Run `fn` in a fresh thread (affinity changes stay there) and return its result."""
    out: list[T] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.mark.skipif(len(usable_cpus() & os.sched_getaffinity(0)) < 2, reason="needs two usable cores")
def test_a_thread_bound_like_vllms_compute_thread_moves_to_the_other_cores() -> None:
    compute = min(usable_cpus() & os.sched_getaffinity(0))

    def bound_then_moved() -> tuple[set[int], set[int]]:
        os.sched_setaffinity(0, {compute})  # what vLLM does to its compute thread
        moved = move_off_compute_cores()
        return moved, os.sched_getaffinity(0)

    moved, now = in_thread(bound_then_moved)
    assert compute not in now and moved == now and now


def test_an_unbound_thread_stays_where_it_is() -> None:
    def unbound() -> tuple[set[int], set[int], set[int]]:
        os.sched_setaffinity(0, usable_cpus())
        before = os.sched_getaffinity(0)
        return move_off_compute_cores(), before, os.sched_getaffinity(0)

    moved, before, after = in_thread(unbound)
    assert moved == set() and before == after
