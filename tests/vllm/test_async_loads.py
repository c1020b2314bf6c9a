"""The vLLM connector's background loads (`AsyncLoads`) without vLLM: the real restore engine, a real tiny
model and chunks stored by a real prefill, with a test restorer standing in for the worker engine (it
records what lands and what fails instead of writing vLLM's blocks; the vLLM side runs in
test_vllm_connector.py). The store can hold its reads, as a pod that has not answered yet does.

Every load is reported exactly once: landed, failed (vLLM recomputes its blocks), or finished by vLLM."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from cacheflow_common.engine import Engine, EngineSettings, RestoreJob, RestoreResult
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.save import make_job, save_prefix
from cacheflow_common.store.memory import MemoryStore
from cacheflow_services.vllm_connector.async_loads import AsyncLoads
from cacheflow_services.vllm_connector.plan import LoadSpec

CHUNK = 16
CONFIG = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 1024, "tie_word_embeddings": False}


class HeldStore(MemoryStore):
    """A store whose reads wait until `release` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        self.release.wait(30)
        return super().readv_into(name, views, offset)


class Restorer:
    """What the worker engine lends the loads, recording what lands and what fails."""

    def __init__(self, model: Transformer, store: MemoryStore, policy: str) -> None:
        self.model, self.store, self.policy = model, store, policy
        self.landed: dict[str, RestoreResult] = {}
        self.failed: dict[str, BaseException] = {}
        self.events: list[str] = []
        self.chunks_loaded: dict[str, list[int]] = {}  # by the first token of the prompt: each chunk, as it lands
        self._engine: Engine | None = None

    def engine(self) -> Engine:
        if self._engine is None:
            settings = EngineSettings(layers=range(self.model.config.num_layers), policy=self.policy,
                                      chunk_size=CHUNK)
            self._engine = Engine.for_connector(settings, self.model)  # collect computes
        return self._engine

    def job(self, spec: LoadSpec) -> RestoreJob:
        return make_job(self.model, spec.token_ids, tenant="t", chunk_size=CHUNK)

    def buffer(self, spec: LoadSpec, job: RestoreJob) -> KVBuffer:
        return self.model.new_kv(job.layers, len(job.token_ids))

    def land(self, spec: LoadSpec, job: RestoreJob, result: RestoreResult, *, batch: int) -> set[int]:
        self.landed[spec.req_id] = result
        return set()

    def after_chunk(self, job: RestoreJob, kv: KVBuffer) -> Callable[[int], None]:
        return self.chunks_loaded.setdefault(str(job.token_ids[0]), []).append  # the channel's thread

    def failed_load(self, spec: LoadSpec, exc: BaseException) -> set[int]:
        self.failed[spec.req_id] = exc
        return set(spec.block_ids)

    def event(self, kind: str, **fields: Any) -> None:
        self.events.append(kind)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


@dataclass
class Rig:
    store: HeldStore
    restorer: Restorer
    loads: AsyncLoads
    prompts: dict[str, list[int]]
    kvs: dict[str, KVBuffer]  # each prompt's prefill, as stored


@pytest.fixture
def rig():
    model = Transformer.random(ModelConfig.from_hf_dict(CONFIG), seed=5)
    store = HeldStore()
    prompts = {name: [(i * 7 + 3 * len(name) + ord(name)) % 256 for i in range(4 * CHUNK)] for name in ("a", "b")}
    kvs = {name: save_prefix(model, make_job(model, p, tenant="t", chunk_size=CHUNK), store)
           for name, p in prompts.items()}
    restorer = Restorer(model, store, "load-only")
    r = Rig(store, restorer, AsyncLoads(restorer, timeout_s=30), prompts, kvs)
    yield r
    store.release.set()
    r.loads.close()
    restorer.close()


def spec(name: str, prompt: list[int], first_block: int) -> LoadSpec:
    return LoadSpec(name, tuple(prompt), tuple(range(first_block, first_block + 4)), 0)


def collect_all(loads: AsyncLoads, expected: int, finished: set[str] | None = None
                ) -> tuple[list[str], set[int]]:
    """Collect until `expected` loads were reported (each id as often as it was reported)."""
    done: list[str] = []
    blocks: set[int] = set()
    deadline = time.monotonic() + 30
    while len(done) < expected and time.monotonic() < deadline:
        ids, failed = loads.collect(finished or set(), idle=True)
        done += sorted(ids)
        blocks |= failed
    return done, blocks


def test_every_load_is_reported_once_with_what_it_restored(rig):
    rig.store.release.set()
    rig.loads.start([spec("a", rig.prompts["a"], 0), spec("b", rig.prompts["b"], 4)])
    done, blocks = collect_all(rig.loads, 2)
    assert sorted(done) == ["a", "b"] and blocks == set() and not rig.restorer.failed
    for name, result in rig.restorer.landed.items():
        assert torch.equal(result.kv.data, rig.kvs[name].data)  # loaded chunks, bit for bit
        assert sorted(rig.restorer.chunks_loaded[str(rig.prompts[name][0])]) == [0, 1, 2, 3]  # each told after it
    assert rig.loads.collect(set(), idle=False) == (set(), set()) and rig.loads.in_flight == 0


def test_a_request_vllm_finishes_while_it_loads_is_reported_without_landing(rig):
    rig.loads.start([spec("a", rig.prompts["a"], 0)])
    deadline = time.monotonic() + 30
    while "load_started" not in rig.restorer.events and time.monotonic() < deadline:
        time.sleep(0.01)
    done, blocks = collect_all(rig.loads, 1, finished={"a"})  # its reads are held: it is mid-restore
    assert done == ["a"] and blocks == set()
    assert not rig.restorer.landed and not rig.restorer.failed  # cancelled, not failed: nobody reads it


def test_a_restore_past_its_timeout_is_cancelled_and_its_blocks_reported(rig):
    loads = AsyncLoads(rig.restorer, timeout_s=0.2)
    try:
        loads.start([spec("b", rig.prompts["b"], 4)])
        done, blocks = collect_all(loads, 1)
        assert done == ["b"] and blocks == {4, 5, 6, 7}
        assert isinstance(rig.restorer.failed["b"], TimeoutError) and not rig.restorer.landed
    finally:
        rig.store.release.set()
        loads.close()


def test_an_idle_collect_returns_while_a_restore_fails_before_it_reaches_the_engine(rig, monkeypatch):
    """A restore can fail while it is being built, before the engine holds it (a pipeline rank whose boundary
    activations are missing): nothing then tells the engine. An idle collect still returns after its slice
    (it used to wait for the engine forever, and vLLM's step with it), and a later one reports the failure."""
    def failing_job(spec: LoadSpec) -> RestoreJob:
        time.sleep(0.3)  # the idle collect is waiting by now
        raise RuntimeError("boundary activations missing")

    monkeypatch.setattr(rig.restorer, "job", failing_job)
    rig.loads.start([spec("a", rig.prompts["a"], 0)])
    first: list[tuple[set[str], set[int]]] = []
    collecting = threading.Thread(target=lambda: first.append(rig.loads.collect(set(), idle=True)), daemon=True)
    collecting.start()
    collecting.join(5)
    assert not collecting.is_alive() and first
    done, blocks = collect_all(rig.loads, 1 - len(first[0][0]))
    assert sorted(first[0][0]) + done == ["a"] and first[0][1] | blocks == {0, 1, 2, 3}
    assert isinstance(rig.restorer.failed["a"], RuntimeError) and not rig.restorer.landed
