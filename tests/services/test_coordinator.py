"""The coordinator end to end: real storage pods, real stage workers and a real coordinator, on loopback.

One local cluster (tiny model, 2 stages, 2 filesystem pods, chunks of 32 tokens) serves the module's
tests; the fault tests that kill a process run last. Completions through the coordinator must equal a
single-process greedy run, whether the prefix was prefilled or restored.
"""

from __future__ import annotations

import itertools
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from cacheflow_common.kv.chunk import decode_kv_chunk
from cacheflow_common.kv.keys import HeadRange, chunk_keys, object_name, tenant_salt
from cacheflow_common.model.sources import load_model
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.save import put_chunk
from cacheflow_common.sim.replay import ReplayRequest
from cacheflow_common.sim.trace import TraceRequest
from cacheflow_common.store.placement import tenant_stores
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_services.coordinator.launch import LocalCoordinator, launch_coordinator
from cacheflow_services.local_cluster import SECRETS_DIR, ClusterSpec, LocalCluster, preflight, start_cluster
from cacheflow_services.replay import ReplayError, replay
from tests.factories import greedy_reference

CHUNK = 32
MODEL = "tiny"
SPEC = ClusterSpec(model=MODEL, stages=2, pods=2, chunk_size=CHUNK, dtype="float32", policy="cake", port=0,
                   transport="tcp", max_batch=4, max_queue=8, threads_per_stage=1, batch_window_ms=30)


@pytest.fixture(scope="module")
def reference() -> Transformer:
    import torch

    return load_model(MODEL, dtype=torch.float32)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    workdir = tmp_path_factory.mktemp("cluster")
    started = start_cluster(SPEC, workdir)
    yield started, workdir
    started.stop()


@pytest.fixture(scope="module")
def client(cluster: tuple[LocalCluster, Path]) -> Iterator[httpx.Client]:
    local, _ = cluster
    with _client(local.coordinator.url, local.token) as c:
        yield c


def _client(url: str, token: str) -> httpx.Client:
    """An API client of the coordinator at `url`."""
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=120)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def _complete(client: httpx.Client, prompt: list[int], n_new: int = 6, **extra: object) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n_new, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_is_prefilled_then_restored_and_both_equal_a_single_process_run(client, reference):
    prompt = _prompt(5 * CHUNK + 7, seed=1)
    _, expected = greedy_reference(reference, prompt, 6)
    first = _complete(client, prompt)
    assert first["choices"][0]["token_ids"] == expected
    assert first["cacheflow"]["prompt_tokens_restored"] == 0
    assert first["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 6, "total_tokens": len(prompt) + 6}
    second = _until_restored(client, prompt)
    assert second["cacheflow"]["prompt_tokens_restored"] == 5 * CHUNK
    assert [s["loaded"] for s in second["cacheflow"]["stages"]] != [0, 0]
    assert second["choices"][0]["token_ids"] == expected
    timing = second["cacheflow"]  # TTFT counts from before the prefix lookup
    assert timing["lookup_s"] > 0 and timing["lookup_s"] + timing["queue_s"] + timing["restore_s"] < timing["ttft_s"]


def _until_restored(client: httpx.Client, prompt: list[int], **extra: Any) -> dict:
    """Send `prompt` until its prefix is restored (the workers store the chunks in the background)."""
    for _ in range(50):
        body = _complete(client, prompt, **extra)
        if body["cacheflow"]["prompt_tokens_restored"]:
            break
    return body


def test_responses_and_the_cluster_name_the_policy_used_and_each_stages_mode(client):
    prompt = _prompt(3 * CHUNK + 5, seed=60)
    first = _complete(client, prompt)
    assert first["cacheflow"]["policy"] == "cake"  # the cluster's default: the fixture's spec says cake
    assert first["cacheflow"]["stage_modes"] == []  # nothing was restored
    named = _until_restored(client, prompt, policy="load-only")["cacheflow"]
    assert named["policy"] == "load-only"
    assert named["stage_modes"] == [s["mode"] for s in named["stages"]] and len(named["stage_modes"]) == 2
    assert set(named["stage_modes"]) <= {"token", "layer"}
    status = client.get("/v1/cluster").json()
    assert status["policy"] == "cake"
    assert all(set(s["restore_modes"]) <= {"token", "layer"} and sum(s["restore_modes"].values()) >= 1
               for s in status["stages"])


def test_the_coordinator_logs_each_request_with_its_id(client, cluster):
    _, workdir = cluster
    prompt = _prompt(2 * CHUNK + 3, seed=61)
    _complete(client, prompt)
    body = _until_restored(client, prompt)
    log = (workdir / "coordinator.log").read_text()
    rid = body["id"]
    assert f"{rid} queued: tenant default, {len(prompt)} prompt tokens, {2 * CHUNK} cached" in log
    assert f"{rid} restored {2 * CHUNK} cached tokens in " in log and "0: cake token (" in log
    assert f"{rid} first token: TTFT " in log


def test_a_longer_prompt_restores_the_shared_prefix(client, reference):
    base = _prompt(4 * CHUNK, seed=2)
    _complete(client, [*base, 5])
    longer = base + _prompt(CHUNK + 3, seed=3)
    _, expected = greedy_reference(reference, longer, 4)
    body = _complete(client, longer, n_new=4)
    assert body["cacheflow"]["prompt_tokens_restored"] in (0, 4 * CHUNK)  # 0 only if the saves were late
    assert body["choices"][0]["token_ids"] == expected


def test_streamed_tokens_equal_the_whole_response(client, reference):
    prompt = _prompt(3 * CHUNK + 1, seed=4)
    _, expected = greedy_reference(reference, prompt, 5)
    with client.stream("POST", "/v1/completions",
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "stream": True}) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["cacheflow"]["ttft_s"] > 0


def test_stop_token_ends_the_completion_early(client, reference):
    prompt = _prompt(40, seed=5)
    _, expected = greedy_reference(reference, prompt, 6)
    body = _complete(client, prompt, stop_token_ids=[expected[2]])
    cut = expected.index(expected[2])
    assert body["choices"][0]["token_ids"] == expected[:cut]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_are_batched_and_all_correct(client, reference):
    prompts = [_prompt(2 * CHUNK + i, seed=10 + i) for i in range(4)]
    expected = [greedy_reference(reference, p, 3)[1] for p in prompts]
    results: list[dict] = [{}] * len(prompts)

    def run(i: int) -> None:
        results[i] = _complete(client, prompts[i], n_new=3)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r["choices"][0]["token_ids"] for r in results] == expected
    assert len({r["cacheflow"]["batch"] for r in results}) < len(prompts)  # some were admitted together


def test_restore_api_restores_holds_and_releases(client):
    prefix = _prompt(4 * CHUNK, seed=20)
    _complete(client, [*prefix, 1], n_new=1)
    created = client.post("/v1/restore", json={"token_ids": prefix}).json()
    done = client.get(f"/v1/restore/{created['id']}", params={"wait": 60}).json()
    assert done["state"] == "ready", done
    assert len(done["stages"]) == 2 and done["restore_s"] > 0
    assert client.delete(f"/v1/restore/{created['id']}").json()["state"] == "released"


@pytest.mark.parametrize(("body", "status", "reason"), [
    ({"model": "other", "prompt": [1, 2]}, 404, "not served"),
    ({"model": MODEL, "prompt": [1, 10**7]}, 400, "vocabulary"),
    ({"model": MODEL, "prompt": [1] * 10**6, "max_tokens": 1}, 400, "context"),
    ({"model": MODEL, "prompt": "text"}, 400, "no tokenizer"),
    ({"model": MODEL, "prompt": [1], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL}, 400, "prompt"),
])
def test_bad_requests_get_a_reason(client, body, status, reason):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert reason in r.json()["error"]["message"]


def test_a_compute_only_completion_prefills_the_whole_prompt_as_vllm_does_on_a_miss(client, reference):
    prompt = _prompt(4 * CHUNK + 3, seed=5)
    _complete(client, prompt)  # its chunks are stored now ...
    r = _until_restored(client, prompt)
    assert r["cacheflow"]["prompt_tokens_restored"] > 0
    again = _complete(client, prompt, policy="compute-only")  # ... but compute-only reads none of them
    assert again["cacheflow"]["prompt_tokens_restored"] == 0 and again["cacheflow"]["stages"] == []
    assert again["choices"][0]["token_ids"] == greedy_reference(reference, prompt, 6)[1]


def test_requests_refused_for_their_policy_hold_no_batch_slot(client, reference):
    for _ in range(6):  # more than the cluster's max_batch of 4: a leaked slot each would lock it up
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "policy": "fastest"})
        assert r.status_code == 400 and "unknown policy 'fastest'" in r.json()["error"]["message"]
    prompt = _prompt(40, seed=77)
    assert _complete(client, prompt, n_new=2)["choices"][0]["token_ids"] == greedy_reference(reference, prompt, 2)[1]
    metrics = client.get("/metrics").text
    assert "\ncacheflow_running 0.0\n" in metrics  # every slot is free again


def test_malformed_json_unknown_restore_and_missing_token_are_refused(client, cluster):
    r = client.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert client.get("/v1/restore/rst-nope").status_code == 404
    local, _ = cluster
    anonymous = httpx.post(f"{local.coordinator.url}/v1/completions", json={"model": MODEL, "prompt": [1]})
    assert anonymous.status_code == 401
    wrong = {"Authorization": "Bearer not-a-token"}
    assert httpx.get(f"{local.coordinator.url}/v1/models", headers=wrong).status_code == 401


def test_metrics_report_ttft_batches_and_restored_tokens(client, cluster):
    local, _ = cluster
    text = httpx.get(f"{local.coordinator.url}/metrics").text
    for name in ("cacheflow_ttft_seconds_count", "cacheflow_batch_size_count", "cacheflow_queue_depth",
                 'cacheflow_prefix_tokens_total{source="restored"}', 'cacheflow_stage_up{stage="1"} 1.0',
                 "cacheflow_restored_token_layers_total"):
        assert name in text, name


def test_a_replay_that_loses_a_request_names_it_and_the_coordinators_answer(cluster):
    local, _ = cluster
    ok = ReplayRequest(trace=TraceRequest(request_id="ok", arrival_s=0.0, input_length=40, cached_tokens=0),
                       token_ids=_prompt(40, seed=7))
    bad = ReplayRequest(trace=TraceRequest(request_id="bad", arrival_s=0.0, input_length=3, cached_tokens=0),
                        token_ids=[1, 2, 10**9])  # a token id outside the vocabulary
    with pytest.raises(ReplayError, match=r"requests \['bad'\] failed: bad: HTTP 400: .*vocabulary"):
        replay(local.coordinator.url, local.token, MODEL, [ok, bad], "cake")


def test_a_full_queue_answers_429(cluster, tmp_path):
    local, workdir = cluster
    narrow = _second_coordinator(local, workdir, tmp_path, "--max-batch", "1", "--max-queue", "0")
    statuses: list[int] = []
    try:
        def run() -> None:
            r = httpx.post(f"{narrow.url}/v1/completions", headers={"Authorization": f"Bearer {local.token}"},
                           json={"model": MODEL, "prompt": _prompt(3000, seed=30), "max_tokens": 1}, timeout=120)
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert r.headers["Retry-After"] and "waiting" in r.json()["error"]["message"]

        threads = [threading.Thread(target=run) for _ in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        narrow.stop()
    assert 200 in statuses and 429 in statuses, statuses


def _second_coordinator(local: LocalCluster, workdir: Path, tmp_path: Path, *extra: str) -> LocalCoordinator:
    pods = [f"pod-{i}=127.0.0.1:{p.data_port}" for i, p in enumerate(local.pods)]
    return launch_coordinator(tmp_path, stages=[w.url for w in local.workers], pods=pods,
                              pod_token_file=workdir / "pod-tokens", token_file=workdir / "api-tokens",
                              secrets=workdir / SECRETS_DIR, model=MODEL, extra=list(extra))


def test_chunks_a_tensor_parallel_vllm_instance_stored_are_restored(client, cluster, reference):
    """A TP 2 vLLM instance's ranks store each chunk as two objects, one per rank's KV heads: once the workers'
    whole objects of a prompt are replaced by such (taken apart here), the coordinator still finds its prefix,
    and the stage workers restore it out of the two runs, with a single-process run's tokens."""
    local, workdir = cluster
    prompt = _prompt(5 * CHUNK + 3, seed=50)
    _, expected = greedy_reference(reference, prompt, 4)
    for _ in range(50):  # until every chunk is stored whole by the stage workers (they store in the background)
        if _complete(client, prompt, n_new=4)["cacheflow"]["prompt_tokens_restored"] == 5 * CHUNK:
            break
    tenant_token = dict(line.split() for line in (workdir / "pod-tokens").read_text().splitlines())[local.tenant]
    addresses = [PodAddress.parse(f"pod-{i}=127.0.0.1:{p.data_port}") for i, p in enumerate(local.pods)]
    store = tenant_stores(addresses, {local.tenant: tenant_token})[local.tenant]
    keys = chunk_keys(prompt[: 5 * CHUNK], CHUNK, tenant_salt(reference.fingerprint(), local.tenant))
    heads = HeadRange(0, reference.config.num_kv_heads, reference.config.num_kv_heads)
    try:
        for key, layers in itertools.product(keys, preflight(SPEC)):
            whole = object_name(key, "kv", layers.start, layers.stop)
            trailer, kv = decode_kv_chunk(store.read(whole) or b"")  # [L, 2, H, C, D]
            for run in heads.parts(2):
                put_chunk(store, key, prompt, kv[:, :, run.start : run.stop], model_fingerprint=trailer["model"],
                          layers=layers, dtype=trailer["dtype"], heads=run)
            store.delete(whole)
        body = _complete(client, prompt, n_new=4)
    finally:
        store.close()
    assert body["cacheflow"]["prompt_tokens_restored"] == 5 * CHUNK
    assert body["choices"][0]["token_ids"] == expected


def test_a_killed_storage_pod_is_recomputed_around(client, cluster, reference):
    local, _ = cluster
    prompt = _prompt(6 * CHUNK + 2, seed=40)
    _, expected = greedy_reference(reference, prompt, 4)
    _complete(client, prompt, n_new=4)
    local.pods[1].kill()
    body = _complete(client, prompt, n_new=4)
    assert body["choices"][0]["token_ids"] == expected


def test_a_killed_stage_worker_fails_requests_with_a_reason_not_a_hang(cluster, tmp_path):
    """A request that finds a stage down waits `--stage-wait-s` for it (30 s by default, for a supervisor's restart;
    1 s here), then answers 503 with the reason."""
    local, workdir = cluster
    impatient = _second_coordinator(local, workdir, tmp_path, "--stage-wait-s", "1")
    try:
        with _client(impatient.url, local.token) as client:
            local.workers[1].kill()
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": _prompt(50, seed=50), "max_tokens": 2})
            assert r.status_code in (502, 503), r.text
            message = r.json()["error"]["message"]
            assert "unreachable" in message or "not answering" in message
            deadline = time.monotonic() + 15  # the health probe (every 2 s) marks the stage down
            while time.monotonic() < deadline:
                r = client.post("/v1/completions",
                                json={"model": MODEL, "prompt": _prompt(50, seed=51), "max_tokens": 2})
                if r.status_code == 503:
                    break
                time.sleep(0.5)
            assert r.status_code == 503 and "stage worker(s) 1 not answering" in r.json()["error"]["message"]
            assert httpx.get(f"{impatient.url}/readyz").status_code == 503
            assert httpx.get(f"{local.coordinator.url}/readyz").status_code == 503
    finally:
        impatient.stop()

