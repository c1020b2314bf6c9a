"""Zero trust inside the cluster, against real processes: the attacks that worked on the stage workers'
open API (KV poisoning, a pool grab, cross-tenant reads) are refused, and what the coordinator's grant
says (its request, its tenant, save or not, how many tokens) is what a worker does."""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch

from cacheflow_common.auth import GrantIssuer, GrantSigner, generate_signing_pair
from cacheflow_common.model.sources import model_config
from cacheflow_common.transport import frames
from cacheflow_services.local_cluster import SECRETS_DIR, LocalCluster
from tests.reliability.coordinator_checks import WAIT_S, local_file, second_coordinator, small_cluster

CHUNK = 32
TENANT = "default"


def _issuer(local: LocalCluster) -> GrantIssuer:
    """The coordinator's credentials (what an attacker who reached a worker does not have)."""
    pod_token = local_file(local, "pod-tokens").read_text().split()[1]
    return GrantIssuer.from_dir(local_file(local, SECRETS_DIR), {TENANT: pod_token})


def _prompt(seed: int, chunks: int = 4) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(chunks * CHUNK + 1)]


def _complete(client: httpx.Client, prompt: list[int], **extra: object) -> list[int]:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8, **extra})
    assert r.status_code == 200, r.text
    return [int(t) for t in r.json()["choices"][0]["token_ids"]]


def _flush(local: LocalCluster) -> None:
    for worker in local.workers:
        httpx.post(f"{worker.url}/v1/flush", headers=worker.internal_headers, timeout=WAIT_S).raise_for_status()


def _chunk_files(local: LocalCluster) -> set[Path]:
    return {f for i in range(len(local.pods)) for f in local_file(local, f"pod-{i}").rglob("*") if f.is_file()
            and ".kv." in f.name}


def _poisoned_forward(local: LocalCluster, prompt: list[int], headers: dict[str, str], grant: str = "") -> int:
    """The attack of the report: stage 1 asked to prefill (and save) the tenant's prefix from random hidden states."""
    hidden = model_config("tiny").hidden_size
    meta = {"request_id": "evil", "tenant": TENANT, "start": 0, "token_ids": prompt[:-1], "save": True,
            "reserve_tokens": 0, "grant": grant}
    body = frames.pack(meta, torch.randn(len(prompt) - 1, hidden))
    r = httpx.post(f"{local.workers[1].url}/v1/forward", content=body,
                   headers={"Content-Type": frames.CONTENT_TYPE, **headers}, timeout=WAIT_S)
    httpx.post(f"{local.workers[1].url}/v1/flush", headers=headers, timeout=WAIT_S)  # as the attacker did
    return r.status_code


def test_the_kv_poisoning_attack_is_refused_and_answers_stay_right(local, client):
    prompt = _prompt(seed=1)
    first = _complete(client, prompt)  # prefilled and stored
    _flush(local)
    assert _poisoned_forward(local, prompt, headers={}) == 401  # no internal token: refused before the body
    internal = local.workers[1].internal_headers  # even a stolen internal token does not let one name a tenant
    assert _poisoned_forward(local, prompt, internal) == 403
    forged = GrantSigner(generate_signing_pair()[0])
    forged_grant = GrantIssuer(_issuer(local).internal_token, forged, {}).issue("evil", TENANT, save=True,
                                                                                max_tokens=1 << 16)
    assert _poisoned_forward(local, prompt, internal, grant=forged_grant) == 403
    wrong_request = _issuer(local).issue("someone-else", TENANT, save=True, max_tokens=1 << 16)
    assert _poisoned_forward(local, prompt, internal, grant=wrong_request) == 403
    _flush(local)
    for _ in range(2):  # restored from storage now: the same answer as the prefill's
        assert _complete(client, prompt) == first


def _status_before_the_body(url: str, method: str, path: str, headers: dict[str, str]) -> int:
    """The status a server answers to headers that announce a 1 GB body, sent without it: it can only
    answer (rather than wait for the body, until our timeout) if it decides on the headers alone."""
    host, port = url.removeprefix("http://").split(":")
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Content-Length: 999999999",
             *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        status_line = sock.makefile("rb").readline().decode()
    return int(status_line.split()[1])


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/restore"), ("POST", "/v1/forward"), ("POST", "/v1/deliver"), ("POST", "/v1/flush"),
    ("GET", "/v1/info"), ("GET", "/v1/requests/any/kv"), ("DELETE", "/v1/requests/any")])
def test_every_worker_endpoint_refuses_a_caller_without_the_internal_token(local, method, path):
    for worker in local.workers:
        token = worker.internal_headers["Authorization"].removeprefix("Bearer ")
        for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": f"Basic {token}"}):
            assert _status_before_the_body(worker.url, method, path, headers) == 401, (path, headers)
            r = httpx.request(method, f"{worker.url}{path}", headers=headers, timeout=WAIT_S)
            assert r.status_code == 401 and "internal" in r.json()["detail"], (path, headers, r.text)
        assert httpx.get(f"{worker.url}/healthz").status_code == 200  # probes and metrics stay open
        assert httpx.get(f"{worker.url}/metrics").status_code == 200


def test_the_pool_grab_and_cross_tenant_reads_are_refused(local, client):
    prompt = _prompt(seed=2)
    _complete(client, prompt)
    _flush(local)
    grab = {"request_id": "grab", "tenant": TENANT, "token_ids": prompt[:-1], "reserve_tokens": 100_000}
    for worker in local.workers:
        assert httpx.post(f"{worker.url}/v1/restore", json=grab, timeout=WAIT_S).status_code == 401
        r = httpx.post(f"{worker.url}/v1/restore", json=grab, headers=worker.internal_headers, timeout=WAIT_S)
        assert r.status_code == 403  # no grant
        granted = _issuer(local).issue("grab", TENANT, save=True, max_tokens=len(prompt) + 16)
        r = httpx.post(f"{worker.url}/v1/restore", json={**grab, "grant": granted}, headers=worker.internal_headers,
                       timeout=WAIT_S)
        assert r.status_code == 403 and "granted at most" in r.json()["detail"]  # more than the grant allows
        assert httpx.get(f"{worker.url}/readyz").status_code == 200
        assert httpx.get(f"{worker.url}/v1/requests/grab/kv", timeout=WAIT_S).status_code == 401
    assert _complete(client, _prompt(seed=3)) is not None  # the cluster still serves


def test_a_request_may_not_touch_another_tenants_session(local):
    issuer = _issuer(local)
    stage0 = local.workers[0]
    meta = {"request_id": "owned", "tenant": TENANT, "start": 0, "token_ids": [1, 2, 3], "save": False,
            "reserve_tokens": 4, "grant": issuer.issue("owned", TENANT, save=False, max_tokens=7)}
    r = httpx.post(f"{stage0.url}/v1/forward", content=frames.pack(meta), timeout=WAIT_S,
                   headers={"Content-Type": frames.CONTENT_TYPE, **stage0.internal_headers})
    assert r.status_code == 200, r.text
    other = {**meta, "tenant": "intruder", "start": 3, "token_ids": [4],
             "grant": issuer.issue("owned", "intruder", save=False, max_tokens=7)}
    r = httpx.post(f"{stage0.url}/v1/forward", content=frames.pack(other), timeout=WAIT_S,
                   headers={"Content-Type": frames.CONTENT_TYPE, **stage0.internal_headers})
    assert r.status_code == 403 and "another tenant" in r.json()["detail"]
    for worker in local.workers:
        httpx.delete(f"{worker.url}/v1/requests/owned", headers=worker.internal_headers, timeout=WAIT_S)


def test_save_false_stores_nothing_not_even_the_chunks_a_restore_recomputed(local, client):
    prompt = _prompt(seed=4, chunks=6)
    _complete(client, prompt)
    _flush(local)
    stored = _chunk_files(local)
    assert stored
    victim = sorted(stored)[len(stored) // 2]
    victim.unlink()  # a miss: the restore recomputes that chunk
    _complete(client, prompt, save=False)
    _flush(local)
    assert not victim.exists(), "a save: false request stored the chunk its restore recomputed"
    assert _chunk_files(local) == stored - {victim}
    _complete(client, prompt)  # save: true (the default) puts it back
    _flush(local)
    assert victim.exists()


def test_a_hold_nobody_uses_is_freed_after_its_ttl(tmp_path_factory):
    cluster = small_cluster(tmp_path_factory, worker_args=["--hold-ttl-s", "1"])
    local = next(cluster)
    try:
        stage0 = local.workers[0]
        meta = {"request_id": "forgotten", "tenant": TENANT, "start": 0, "token_ids": [1, 2, 3], "save": False,
                "reserve_tokens": 4, "grant": _issuer(local).issue("forgotten", TENANT, save=False, max_tokens=7)}
        r = httpx.post(f"{stage0.url}/v1/forward", content=frames.pack(meta), timeout=WAIT_S,
                       headers={"Content-Type": frames.CONTENT_TYPE, **stage0.internal_headers})
        assert r.status_code == 200, r.text
        kv = f"{stage0.url}/v1/requests/forgotten/kv"
        assert httpx.get(kv, headers=stage0.internal_headers, timeout=WAIT_S).status_code == 200
        deadline = time.monotonic() + 30
        while httpx.get(kv, headers=stage0.internal_headers, timeout=WAIT_S).status_code != 404:
            assert time.monotonic() < deadline, "the idle hold was never freed"
            time.sleep(0.2)
    finally:
        next(cluster, None)


def test_workers_get_no_tenant_storage_token(local):
    pod_token = local_file(local, "pod-tokens").read_text().split()[1]
    for worker in local.workers:
        assert "--pod-token-file" not in worker.args
        assert not any(pod_token in arg for arg in worker.args)


def test_a_tenant_holds_at_most_its_share_of_restores(local, client, tmp_path):
    prompt = _prompt(seed=5)
    _complete(client, prompt)
    _flush(local)
    narrow = second_coordinator(local, tmp_path, "--max-held-restores", "2")
    try:
        with httpx.Client(base_url=narrow.url, headers={"Authorization": f"Bearer {local.token}"},
                          timeout=WAIT_S) as c:
            held = [c.post("/v1/restore", json={"token_ids": prompt[:-1]}) for _ in range(2)]
            assert all(r.status_code == 200 for r in held), [r.text for r in held]
            third = c.post("/v1/restore", json={"token_ids": prompt[:-1]})
            assert third.status_code == 429 and "the limit per tenant" in third.json()["detail"]
            assert c.delete(f"/v1/restore/{held[0].json()['id']}").status_code == 200
            assert c.post("/v1/restore", json={"token_ids": prompt[:-1]}).status_code == 200
    finally:
        narrow.stop()
