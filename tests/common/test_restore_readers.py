"""Load-only keeps more than one read in flight, in the engine (`restore`) and in the benchmarks' fixed-split
runner, and a reader that fails costs only its own unit: every unit a read failed for is recomputed, and
the KV is still the full prefill's."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch

from cacheflow_common.engine import restore
from cacheflow_common.restore.executor import LOAD_ONLY_READS_IN_FLIGHT, run_fixed_split
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.store.memory import MemoryStore
from tests.common.test_restore import ATOL, CHUNK, _case
from tests.factories import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=0, num_layers=4)


class WatchedStore(MemoryStore):
    """A memory store whose reads take a while, counting how many run at once; reads of `failing`
    names raise, as a store that lost its connection does."""

    def __init__(self, failing: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.failing = failing
        self.now = self.most = 0
        self._watch = threading.Lock()

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        if any(part in name for part in self.failing):
            raise ConnectionError(f"store lost reading {name}")
        with self._watch:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(0.01)  # long enough for the other reader to start its own read
        try:
            return super().readv_into(name, views, offset)
        finally:
            with self._watch:
                self.now -= 1


def _check_kv(case, result) -> None:
    got, ref = result.kv.data[:, :, :, : case.n], case.ref.data[:, :, :, : case.n]
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=ATOL)


def test_load_only_keeps_several_reads_in_flight(model):
    store = WatchedStore()
    case = _case(model, 6 * CHUNK, seed=3, store=store)
    result = restore(case.job, model=model, store=store, policy="load-only", kv=case.kv)
    assert store.most == LOAD_ONLY_READS_IN_FLIGHT >= 2
    assert result.sources() == ["loaded"] * len(result.units) and not result.misses
    _check_kv(case, result)


def test_several_readers_load_layer_wise_too(model):
    store = WatchedStore()
    case = _case(model, 2 * CHUNK, seed=6, store=store)
    loader = KVLoader(store=store, keys=case.job.keys, layers=case.job.layers, kv=case.kv, dtype=case.job.kv_dtype,
                      quant=case.job.quant)
    result = run_fixed_split(case.job, model=model, loader=loader, mode="layer", split=0, reads_in_flight=2)
    assert store.most == 2 and result.sources() == ["loaded"] * model.config.num_layers
    _check_kv(case, result)


def test_a_failing_reader_loses_only_its_unit_while_another_reads(model):
    store = WatchedStore()
    case = _case(model, 6 * CHUNK, seed=4, store=store)
    store.failing = (case.job.keys[4].hex,)  # one chunk's reads raise
    result = restore(case.job, model=model, store=store, policy="load-only", kv=case.kv)
    sources = result.sources()
    assert sources[4] == "computed" and result.units[4].miss_reason == "loader-error: ConnectionError"
    assert sources.count("loaded") >= 2  # the other reader went on after the failure
    _check_kv(case, result)


def test_when_every_reader_fails_the_rest_is_recomputed(model):
    store = WatchedStore()
    case = _case(model, 6 * CHUNK, seed=5, store=store)
    store.failing = ("kv",)  # every read raises
    result = restore(case.job, model=model, store=store, policy="load-only", kv=case.kv)
    assert result.sources() == ["computed"] * len(result.units)
    _check_kv(case, result)
