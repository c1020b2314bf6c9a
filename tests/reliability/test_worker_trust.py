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

from cacheflow_common.auth import GRANT_HEADER, GrantIssuer, GrantSigner, generate_signing_pair, input_digest
from cacheflow_common.model.sources import model_config
from cacheflow_common.transport import frames
from cacheflow_services.local_cluster import SECRETS_DIR, LocalCluster
from cacheflow_services.worker.routes import ROUTES, Credential
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
        worker.flush(WAIT_S)


def _chunk_files(local: LocalCluster) -> set[Path]:
    return {f for i in range(len(local.pods)) for f in local_file(local, f"pod-{i}").rglob("*") if f.is_file()
            and ".kv." in f.name}


def _forward_grant(issuer: GrantIssuer, request_id: str, token_ids: list[int], *, stages: list[int],
                   start: int = 0, reserve: int = 0, save: bool = True) -> str:
    return issuer.issue("forward", stages=stages, request_id=request_id, tenant=TENANT, save=save,
                        digest=input_digest(token_ids, start=start, reserve=reserve), max_tokens=1 << 16)


def _poisoned_forward(local: LocalCluster, prompt: list[int], headers: dict[str, str], grant: str = "",
                      hidden: torch.Tensor | None = None) -> httpx.Response:
    """The attack of the report: stage 1 asked to prefill (and save) the tenant's prefix from random hidden states."""
    meta = {"request_id": "evil", "tenant": TENANT, "start": 0, "token_ids": prompt[:-1], "save": True,
            "reserve_tokens": 0}
    garbage = torch.randn(len(prompt) - 1, model_config("tiny").hidden_size) if hidden is None else hidden
    r = httpx.post(f"{local.workers[1].url}/v1/forward", content=frames.pack(meta, garbage), timeout=WAIT_S,
                   headers={"Content-Type": frames.CONTENT_TYPE, GRANT_HEADER: grant, **headers})
    httpx.post(f"{local.workers[1].url}/v1/flush", headers=headers, timeout=WAIT_S)  # as the attacker did
    return r


def test_the_kv_poisoning_attack_is_refused_and_answers_stay_right(local, client):
    prompt = _prompt(seed=1)
    first = _complete(client, prompt)  # prefilled and stored
    _flush(local)
    assert _poisoned_forward(local, prompt, headers={}).status_code == 401  # no internal token: refused at once
    internal = local.workers[1].internal_headers  # even a stolen internal token does not let one name a tenant
    assert _poisoned_forward(local, prompt, internal).status_code == 403
    issuer = _issuer(local)
    forged = GrantIssuer(issuer.internal_token, GrantSigner(generate_signing_pair()[0]), {})
    refusals = {
        "forged": _forward_grant(forged, "evil", prompt[:-1], stages=[1]),
        "other request": _forward_grant(issuer, "someone-else", prompt[:-1], stages=[1]),
        "other stage": _forward_grant(issuer, "evil", prompt[:-1], stages=[0]),
        "other tokens": _forward_grant(issuer, "evil", prompt[:-2], stages=[1]),
        "other operation": issuer.issue("restore", stages=[1], request_id="evil", tenant=TENANT, save=True,
                                        digest=input_digest(prompt[:-1]), max_tokens=1 << 16),
        "expired": issuer.issue("forward", stages=[1], request_id="evil", tenant=TENANT, save=True, ttl_s=-60,
                                digest=input_digest(prompt[:-1]), max_tokens=1 << 16),
    }
    for why, grant in refusals.items():
        assert _poisoned_forward(local, prompt, internal, grant=grant).status_code == 403, why
    # a real grant (one that stores nothing), as the coordinator sent it, replayed: refused (a grant is good once)
    replayed = _forward_grant(issuer, "evil", prompt[:-1], stages=[1], save=False)
    nan = torch.full((len(prompt) - 1, model_config("tiny").hidden_size), float("nan"))
    refused = _poisoned_forward(local, prompt, internal, grant=replayed, hidden=nan)
    assert refused.status_code == 400 and "finite" in refused.json()["detail"]  # NaN never reaches the model
    assert _poisoned_forward(local, prompt, internal, grant=replayed).status_code == 200  # its one use ...
    httpx.delete(f"{local.workers[1].url}/v1/requests/evil", timeout=WAIT_S, headers=local.workers[1].granted_headers(
        "release", request_id="evil", tenant=TENANT))
    again = _poisoned_forward(local, prompt, internal, grant=replayed)
    assert again.status_code == 403 and "used before" in again.json()["detail"]  # ... and no second
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


GRANTED = [r for r in ROUTES if r.credential is Credential.GRANT]


@pytest.mark.parametrize("route", GRANTED, ids=[r.key for r in GRANTED])
def test_every_worker_route_refuses_a_caller_without_the_token_and_its_grant_before_the_body(local, route):
    path = route.path.replace("{request_id}", "any")
    for worker in local.workers:
        token = worker.internal_headers["Authorization"].removeprefix("Bearer ")
        for headers in ({}, {"Authorization": "Bearer not-the-token"}, {"Authorization": f"Basic {token}"}):
            assert _status_before_the_body(worker.url, route.method, path, headers) == 401, (path, headers)
            r = httpx.request(route.method, f"{worker.url}{path}", headers=headers, timeout=WAIT_S)
            assert r.status_code == 401 and "internal" in r.json()["detail"], (path, headers, r.text)
        other_op = "flush" if route.op != "flush" else "info"
        for headers in (worker.internal_headers, worker.granted_headers(other_op),  # no grant; another's
                        local.workers[1 - worker.stage].granted_headers(route.op)):  # another stage's
            assert _status_before_the_body(worker.url, route.method, path, headers) == 403, (path, headers)
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
        granted = worker.granted_headers("restore", request_id="grab", tenant=TENANT, max_tokens=len(prompt) + 16,
                                         digest=input_digest(prompt[:-1], reserve=100_000))
        r = httpx.post(f"{worker.url}/v1/restore", json=grab, headers=granted, timeout=WAIT_S)
        assert r.status_code == 403 and "granted at most" in r.json()["detail"]  # more than the grant allows
        assert httpx.get(f"{worker.url}/readyz").status_code == 200
        assert httpx.get(f"{worker.url}/v1/requests/grab/kv", timeout=WAIT_S).status_code == 401
    assert _complete(client, _prompt(seed=3)) is not None  # the cluster still serves


def _open(local: LocalCluster, request_id: str, tenant: str = TENANT, start: int = 0,
          token_ids: tuple[int, ...] = (1, 2, 3)) -> httpx.Response:
    """A forward on stage 0 (the last stage answers) with the coordinator's grant for it."""
    stage0, issuer = local.workers[0], _issuer(local)
    meta = {"request_id": request_id, "tenant": tenant, "start": start, "token_ids": list(token_ids), "save": False,
            "reserve_tokens": 4}
    grant = issuer.issue("forward", stages=[0, 1], request_id=request_id, tenant=tenant, max_tokens=7,
                         digest=input_digest(token_ids, start=start, reserve=4))
    return httpx.post(f"{stage0.url}/v1/forward", content=frames.pack(meta), timeout=WAIT_S,
                      headers={"Content-Type": frames.CONTENT_TYPE, GRANT_HEADER: grant, **stage0.internal_headers})


def test_a_request_may_not_touch_another_tenants_session(local):
    stage0 = local.workers[0]
    assert _open(local, "owned").status_code == 200
    r = _open(local, "owned", tenant="intruder", start=3, token_ids=(4,))
    assert r.status_code == 403 and "another tenant" in r.json()["detail"]
    for op, method, path in (("read", "GET", "/v1/requests/owned/kv"), ("release", "DELETE", "/v1/requests/owned")):
        r = httpx.request(method, f"{stage0.url}{path}", timeout=WAIT_S,
                          headers=stage0.granted_headers(op, request_id="owned", tenant="intruder"))
        assert r.status_code == 403 and "another tenant" in r.json()["detail"], op
    kv = httpx.get(f"{stage0.url}/v1/requests/owned/kv", timeout=WAIT_S,
                   headers=stage0.granted_headers("read", request_id="owned", tenant=TENANT))
    assert kv.status_code == 200  # still there for its own tenant
    for worker in local.workers:
        httpx.delete(f"{worker.url}/v1/requests/owned", timeout=WAIT_S,
                     headers=worker.granted_headers("release", request_id="owned", tenant=TENANT))


def test_deliveries_need_a_grant_and_a_granted_mailbox_is_bounded(local):
    stage1 = local.workers[1]
    hidden = model_config("tiny").hidden_size

    def deliver(grant: str, rows: int, index: int = 0) -> httpx.Response:
        body = frames.pack({"request_id": "early", "index": index}, torch.zeros(rows, hidden))
        return httpx.post(f"{stage1.url}/v1/deliver", content=body, timeout=WAIT_S,
                          headers={"Content-Type": frames.CONTENT_TYPE, GRANT_HEADER: grant, **stage1.internal_headers})

    assert deliver("", 4).status_code == 403  # nothing is kept for an id nobody granted
    grant = _issuer(local).issue("deliver", stages=[1], request_id="early", tenant=TENANT, max_tokens=8,
                                 digest=input_digest([1] * 8))
    assert deliver(grant, 4).status_code == 200
    r = deliver(grant, 5, index=1)
    assert r.status_code == 409 and "exceed its grant" in r.json()["detail"]  # 9 rows where 8 were granted
    other = _issuer(local).issue("deliver", stages=[1], request_id="early", tenant=TENANT, max_tokens=8,
                                 digest=input_digest([1] * 8))
    assert deliver(other, 1, index=1).status_code == 403  # one stream per request
    httpx.delete(f"{stage1.url}/v1/requests/early", timeout=WAIT_S,
                 headers=stage1.granted_headers("release", request_id="early", tenant=TENANT))
    assert deliver(grant, 1, index=1).status_code == 403  # its stream closed with the request: not reopened


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
        r = _open(local, "forgotten")
        assert r.status_code == 200, r.text
        kv = f"{stage0.url}/v1/requests/forgotten/kv"

        def read() -> int:
            headers = stage0.granted_headers("read", request_id="forgotten", tenant=TENANT)
            return httpx.get(kv, headers=headers, timeout=WAIT_S).status_code

        assert read() == 200
        deadline = time.monotonic() + 30
        while read() != 404:
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
            assert third.status_code == 429 and "the limit per tenant" in third.json()["error"]["message"]
            assert c.delete(f"/v1/restore/{held[0].json()['id']}").status_code == 200
            assert c.post("/v1/restore", json={"token_ids": prompt[:-1]}).status_code == 200
    finally:
        narrow.stop()
