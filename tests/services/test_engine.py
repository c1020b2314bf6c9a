"""The stage engine in this process (no HTTP): one compute loop and one loader per channel serve many
requests at once. A tiny seeded model, chunks in memory stores, loads slowed by a token bucket so that
both pointers take units.

* a batch of concurrent restores gives each request the KV of its own full prefill;
* the compute loop runs one batched forward per step over several requests, not one request at a time;
* continuous batching (prefill and decode of several requests in the same steps) gives each request the
  greedy tokens it gets alone;
* the worker's scheduler decisions are a function of the events it was told: replayed into a fresh
  `BatchScheduler` — the class the simulator drives — the same events give the same decisions.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from cacheflow_common.engine import Engine
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.restore.profile import Crossover, Profile
from cacheflow_common.restore.save import compute_prefix_kv, make_job, save_prefix
from cacheflow_common.sched.policies import make_policy
from cacheflow_common.sched.scheduler import BatchScheduler
from cacheflow_common.stage_api import ForwardMeta, RestoreSummary
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.shaped import ShapedStore
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_common.transport.shaping import TokenBucket
from cacheflow_services.worker.config import WorkerConfig
from cacheflow_services.worker.engine import StageEngine
from tests.factories import TINY_COSTS, greedy_reference, tiny_model

CHUNK = 16
TENANT = "alpha"
LOAD_BYTES_PER_S = 2e6  # a chunk of the tiny model (~14 KB) loads in ~7 ms: both pointers take units


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model(seed=3, num_layers=4)


def _profile(model: Transformer) -> Profile:
    return Profile(model=model.fingerprint(), model_name="tiny", dtype="float32", chunk_size=CHUNK, threads=1,
                   costs=TINY_COSTS, crossovers=(Crossover(link_bytes_per_s=LOAD_BYTES_PER_S, l_delta=0),))


def _engine(model: Transformer, store: Any, *, policy: str = "cacheflow", pods: int = 2, **options: Any) -> StageEngine:
    config = WorkerConfig(stage=0, layers=range(model.config.num_layers), last_stage=True, chunk_size=CHUNK,
                          pods=tuple(PodAddress.parse(f"pod-{i}=127.0.0.1:{7400 + i}") for i in range(pods)),
                          pod_tokens={TENANT: "unused: the stores are given"}, policy=policy, **options)
    return StageEngine(config, model, {TENANT: store}, _profile(model), None)


@pytest.fixture
def engines() -> Iterator[list[StageEngine]]:
    made: list[StageEngine] = []
    yield made
    for engine in made:
        engine.close()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(384) for _ in range(CHUNK * rng.randint(3, 6) + rng.randrange(CHUNK))] for _ in range(n)]


def _in_threads(calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run every call at once, each in its own thread; their results in order (re-raising a failure)."""
    results: list[Any] = [None] * len(calls)
    barrier = threading.Barrier(len(calls))

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def _restore_all(engine: StageEngine, prompts: list[list[int]]) -> list[RestoreSummary]:
    """Every prompt's prefix restored at once, request `r{i}` for prompt i."""
    calls = [functools.partial(engine.restore, f"r{i}", ids, tenant=TENANT, input_mode="boundary", reserve_tokens=0)
             for i, ids in enumerate(prompts)]
    return _in_threads(calls)


def _saved_store(model: Transformer, prompts: list[list[int]]) -> ShapedStore:
    inner = MemoryStore()
    for ids in prompts:
        save_prefix(model, make_job(model, ids, tenant=TENANT, chunk_size=CHUNK), inner)
    return ShapedStore(inner, TokenBucket(LOAD_BYTES_PER_S))


@pytest.mark.parametrize("policy", ["cacheflow", "cacheflow-srpt", "cake", "load-only", "compute-only",
                                    "cacheflow-layer"])
def test_concurrent_restores_each_equal_their_own_prefill(model, engines, policy):
    prompts = _prompts(4)
    engine = _engine(model, _saved_store(model, prompts), policy=policy)
    engines.append(engine)
    summaries = _restore_all(engine, prompts)
    for i, (ids, summary) in enumerate(zip(prompts, summaries, strict=True)):
        expected = compute_prefix_kv(model, make_job(model, ids, tenant=TENANT, chunk_size=CHUNK)).data
        torch.testing.assert_close(engine.kv_of(f"r{i}"), expected[:, :, :, : len(ids)], atol=1e-4, rtol=1e-4)
        assert summary.policy == policy and not summary.misses
        units = {"cacheflow-layer": model.config.num_layers, "compute-only": 1}  # one prefill: the strongest
        assert summary.computed + summary.loaded == units.get(policy, -(-len(ids) // CHUNK))
    totals = [(s.computed, s.loaded) for s in summaries]
    if policy == "load-only":
        assert all(c == 0 for c, _ in totals)
    if policy == "compute-only":
        assert all(loaded == 0 for _, loaded in totals)
    if policy in ("cacheflow", "cacheflow-srpt", "cake"):  # the two pointers met inside the batch's prefixes
        assert sum(c for c, _ in totals) > 0 and sum(loaded for _, loaded in totals) > 0


def test_the_compute_loop_runs_one_batch_per_step_not_one_request(model, engines, monkeypatch):
    prompts = _prompts(4, seed=1)
    calls: list[int] = []  # per forward: how many requests' KV buffers it wrote
    forward = model.forward_layers

    def counting(hidden: torch.Tensor, layers: range, spans: list[Span]) -> torch.Tensor:
        calls.append(len({id(s.kv) for s in spans}))
        return forward(hidden, layers, spans)

    store = _saved_store(model, prompts)
    monkeypatch.setattr(model, "forward_layers", counting)
    engine = _engine(model, store, policy="compute-only", prefill_tokens=CHUNK)
    engines.append(engine)
    _restore_all(engine, prompts)
    units = sum(-(-len(ids) // CHUNK) for ids in prompts)
    assert max(calls) == len(prompts), "some step ran a unit of every request restoring"
    assert len(calls) < units, f"{len(calls)} forwards for {units} units: one request per step"
    assert engine.busy()["compute_s"] > 0


def test_a_step_with_forward_work_carries_one_restore_unit_at_most(model, engines):
    prompts = _prompts(4, seed=5)
    engine = _engine(model, _saved_store(model, prompts), policy="compute-only", prefill_tokens=CHUNK)
    engines.append(engine)
    steps: list[tuple[int, int]] = []  # per step: forward slices, restore units
    engine.engine._step_loop.on_step = lambda plan, _s: steps.append((len(plan.forwards), len(plan.token_units)))
    restores = [functools.partial(engine.restore, f"r{i}", ids, tenant=TENANT, input_mode="boundary",
                                  reserve_tokens=0) for i, ids in enumerate(prompts)]
    meta = {"request_id": "f", "tenant": TENANT, "reserve_tokens": 8, "save": False, "start": 0}
    forwards = [functools.partial(engine.forward, ForwardMeta.model_validate({**meta, "request_id": f"f{i}",
                                                                               "token_ids": [1, 2, 3]}), None)
                for i in range(4)]
    _in_threads([*restores, *forwards])
    assert any(f for f, _ in steps) and all(units <= 1 for f, units in steps if f)
    assert max(units for f, units in steps if not f) > 1  # restores alone still batch


@pytest.mark.parametrize("save", [True, False])
def test_a_restored_request_stores_its_new_chunks_only_if_its_forward_says_so(model, engines, save):
    ids = _prompts(1, seed=7)[0]
    prefix = len(ids) // CHUNK * CHUNK - CHUNK  # whole chunks stored; one more fills up during the forward
    store = _saved_store(model, [ids[:prefix]])
    stored = store.inner
    assert isinstance(stored, MemoryStore)
    engine = _engine(model, store)
    engines.append(engine)
    engine.restore("r", ids[:prefix], tenant=TENANT, input_mode="boundary", reserve_tokens=len(ids) - prefix)
    stored_before = len(stored.names())
    meta = {"request_id": "r", "tenant": TENANT, "start": prefix, "token_ids": ids[prefix:], "save": save}
    engine.forward(ForwardMeta.model_validate(meta), None)
    engine.flush()
    assert (len(stored.names()) > stored_before) is save


def test_a_request_whose_sampling_fails_gets_the_error_and_the_others_their_tokens(model, engines):
    engine = _engine(model, MemoryStore())
    engines.append(engine)
    sample = engine.engine._step_loop.sampler

    def failing_for_seed_13(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
        if seed == 13:
            raise ValueError("this seed cannot be sampled")
        return sample(logits, temperature, seed, position)

    engine.engine._step_loop.sampler = failing_for_seed_13
    metas = [ForwardMeta(request_id=f"s{seed}", tenant=TENANT, start=0, token_ids=[1, 2, 3], reserve_tokens=4,
                         save=False, temperature=0.7, seed=seed) for seed in (13, 14)]
    calls = [functools.partial(_outcome, engine.forward, meta, None) for meta in metas]
    (failed, error), (served, answer) = _in_threads(calls)
    assert failed and isinstance(error, ValueError) and not served and isinstance(answer.token, int)


def _outcome(call: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
    """(True, the exception the call raised) or (False, its result)."""
    try:
        return False, call(*args)
    except Exception as exc:
        return True, exc


def test_continuous_batching_gives_each_request_its_greedy_tokens_alone(model, engines):
    prompts = _prompts(4, seed=2)
    n_new = 6
    engine = _engine(model, MemoryStore())
    engines.append(engine)

    def generate(i: int, ids: list[int]) -> list[int]:
        meta = {"request_id": f"g{i}", "tenant": TENANT, "reserve_tokens": len(ids) + n_new, "save": False,
                "temperature": 0.0, "seed": 0}
        tokens = [engine.forward(ForwardMeta.model_validate({**meta, "start": 0, "token_ids": ids}), None).token]
        while len(tokens) < n_new:
            position = len(ids) + len(tokens) - 1
            step = ForwardMeta.model_validate({**meta, "start": position, "token_ids": tokens[-1:]})
            tokens.append(engine.forward(step, None).token)
        return tokens

    together = _in_threads([functools.partial(generate, i, ids) for i, ids in enumerate(prompts)])
    alone = [greedy_reference(model, ids, n_new)[1] for ids in prompts]
    assert together == alone
    assert engine.busy()["compute_s"] > 0  # the loop's steps were timed


class RecordingScheduler(BatchScheduler):
    """A `BatchScheduler` that records every event and decision, and the `ready` answers it was given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, tuple[Any, ...], dict[str, Any], Any, list[bool]]] = []

    def _record(self, name: str, *args: Any, **kwargs: Any) -> Any:
        answers: list[bool] = []
        if kwargs.get("ready") is not None:
            ready = kwargs["ready"]

            def recorded(request_id: str, unit: int) -> bool:
                answers.append(ready(request_id, unit))
                return answers[-1]

            kwargs["ready"] = recorded
        result = getattr(super(), name)(*args, **kwargs)
        self.log.append((name, args, {k: v for k, v in kwargs.items() if k != "ready"}, _decided(name, result),
                         answers))
        return result


def _decided(name: str, result: Any) -> Any:
    """What a call decided, comparable across schedulers: `arrive` answers with its live record, named by id."""
    return result.request_id if name == "arrive" else result


for _name in ("arrive", "computed", "loaded", "load_missed", "step_done", "cancel", "forget",
              "next_compute_batch", "next_load"):
    setattr(RecordingScheduler, _name, lambda self, *a, _n=_name, **k: self._record(_n, *a, **k))


def test_worker_decisions_replay_exactly_in_a_fresh_scheduler(model, engines, monkeypatch):
    prompts = _prompts(5, seed=4)
    recorder = RecordingScheduler(make_policy("cacheflow"), n_stages=1)
    monkeypatch.setattr(Engine, "for_stage", functools.partial(Engine.for_stage, scheduler=recorder))
    engine = _engine(model, _saved_store(model, prompts))
    engines.append(engine)
    _restore_all(engine, prompts)
    log = list(recorder.log)  # a prefix of the calls, in order: the channels may still be asking
    decisions = [entry for entry in log if entry[0].startswith("next_") and entry[3]]
    assert len(decisions) > len(prompts) and any(e[0] == "next_load" for e in decisions)

    fresh = BatchScheduler(recorder.policy, n_stages=1)
    for name, args, kwargs, result, answers in log:
        if name == "next_compute_batch":
            replies = iter(answers)
            kwargs = {**kwargs, "ready": lambda _r, _u, replies=replies: next(replies)}
        assert _decided(name, getattr(fresh, name)(*args, **kwargs)) == result, f"{name}{args} decided differently"
