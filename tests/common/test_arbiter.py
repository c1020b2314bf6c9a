"""The storage-link arbiter: which of the requests restoring on a stage loads next."""

from __future__ import annotations

import functools
import threading
import time

import pytest
import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.restore.arbiter import Lane, LoadArbiter
from cacheflow_common.restore.executor import RestoreResult, restore
from cacheflow_common.restore.save import compute_prefix_kv, make_job, save_prefix
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.shaped import ShapedStore
from cacheflow_common.transport.shaping import TokenBucket
from tests.factories import TINY_COSTS, tiny_model


def _grant_order(arbiter: LoadArbiter, lanes: dict[str, Lane]) -> list[str]:
    """Hold the only slot, let every lane queue, then release it: the order the lanes get it in."""
    holder = arbiter.lane(by_cost=False, remaining_cost=lambda: 0.0)
    assert holder.acquire(lambda: True)
    order: list[str] = []
    lock = threading.Lock()

    def wait_turn(name: str, lane: Lane) -> None:
        assert lane.acquire(lambda: True)
        with lock:
            order.append(name)
        time.sleep(0.02)
        lane.release()

    threads = [threading.Thread(target=wait_turn, args=item) for item in lanes.items()]
    for t in threads:
        t.start()
    while arbiter.waiting < len(lanes):
        time.sleep(0.005)
    holder.release()
    for t in threads:
        t.join()
    return order


def test_cacheflow_lanes_go_by_largest_remaining_recompute_cost():
    arbiter = LoadArbiter(1)
    costs = {"small": 10.0, "large": 1000.0, "medium": 100.0}
    lanes = {name: arbiter.lane(by_cost=True, remaining_cost=functools.partial(float, c)) for name, c in costs.items()}
    assert _grant_order(arbiter, lanes) == ["large", "medium", "small"]


def test_baseline_lanes_go_in_arrival_order():
    arbiter = LoadArbiter(1)
    lanes = {name: arbiter.lane(by_cost=False, remaining_cost=lambda: 1.0) for name in ("first", "second", "third")}
    assert _grant_order(arbiter, lanes) == ["first", "second", "third"]


def test_a_lane_that_no_longer_wants_a_slot_stops_waiting_without_one():
    arbiter = LoadArbiter(1)
    holder = arbiter.lane(by_cost=False, remaining_cost=lambda: 0.0)
    assert holder.acquire(lambda: True)
    done = threading.Event()
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(arbiter.lane(by_cost=True, remaining_cost=lambda: 5.0)
                                                   .acquire(lambda: not done.is_set())))
    t.start()
    time.sleep(0.05)
    done.set()
    t.join(timeout=2)
    assert got == [False] and arbiter.waiting == 0
    holder.release()
    assert arbiter.lane(by_cost=False, remaining_cost=lambda: 0.0).acquire(lambda: True)  # the slot is free


def test_an_arbiter_needs_a_slot():
    with pytest.raises(ConfigError):
        LoadArbiter(0)


@pytest.mark.parametrize("policy", ["cake", "cacheflow-token", "cacheflow-layer"])
def test_concurrent_restores_sharing_one_link_restore_exactly(policy):
    model = tiny_model()
    store = MemoryStore()
    prompts = [[(7 * i + s) % model.config.vocab_size for i in range(96 + 16 * s)] for s in range(3)]
    jobs = [make_job(model, ids, tenant="t", chunk_size=16) for ids in prompts]
    saved = [save_prefix(model, job, store) for job in jobs]
    slow = ShapedStore(store, TokenBucket(4e6))  # loads as slow as compute: both pointers move
    arbiter = LoadArbiter(1)
    results: list[RestoreResult | None] = [None] * len(jobs)

    def run(i: int) -> None:
        results[i] = restore(jobs[i], model=model, store=slow, policy=policy, costs=TINY_COSTS, links=arbiter)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for job, kv, result in zip(jobs, saved, results, strict=True):
        assert result is not None
        n = len(job.token_ids)
        assert torch.allclose(result.kv.data[..., :n, :], kv.data[..., :n, :], atol=1e-4)
        assert torch.allclose(result.kv.data[..., :n, :], compute_prefix_kv(model, job).data[..., :n, :], atol=1e-4)
    assert sum(r.sources().count("loaded") for r in results if r is not None) > 0
