"""Batch slots are freed, and the stages' work stopped, whenever a request is given up, and readiness
says when no slot can free up: real storage pods (their links shaped slow, so that a restore with
`load-only` takes seconds however fast the machine is), stage workers and coordinators, on loopback."""

from __future__ import annotations

import json
import random
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cacheflow_services.local_cluster import LocalCluster
from tests.reliability.coordinator_checks import (
    WAIT_S,
    api_client,
    metric,
    post,
    samples,
    second_coordinator,
    small_cluster,
    wait_for,
)

CHUNK = 32
PREFIX_CHUNKS = 16  # tiny, fp32: 128 KiB of KV per chunk and stage, 4 MiB to load in all ...
RATE_GBPS = 0.004  # ... at 0.5 MB/s per pod: seconds
MODEL = "tiny"
MAX_BATCH = 4


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from small_cluster(tmp_path_factory, max_batch=MAX_BATCH, rate_gbps=RATE_GBPS)


@pytest.fixture(scope="module")
def client(local: LocalCluster) -> Iterator[httpx.Client]:
    yield from api_client(local)


def _stored_prefix(client: httpx.Client, local: LocalCluster, seed: int) -> list[int]:
    """A prefix of PREFIX_CHUNKS whole chunks, prefilled and stored on the pods."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000) for _ in range(PREFIX_CHUNKS * CHUNK)]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [*prefix, 1], "max_tokens": 1,
                                              "policy": "compute-only"})
    assert r.status_code == 200, r.text
    for worker in local.workers:  # its chunks are stored off the critical path: wait for them
        worker.flush(WAIT_S)
    return prefix


def _cancelled_restores(worker_url: str) -> float:
    return metric(worker_url, "cacheflow_worker_restore_failures_total", {"reason": "RestoreCancelledError"}) or 0.0


def _loading(local: LocalCluster, before: list[float]) -> bool:
    """Every stage has loaded something since `before` (their channels' busy seconds)."""
    return all(_channel_busy(w.url) > b for w, b in zip(local.workers, before, strict=True))


def _channel_busy(worker_url: str) -> float:
    return metric(worker_url, "cacheflow_worker_channel_busy_seconds_total", {"channel": "0"}) or 0.0


def _holding_nothing(local: LocalCluster) -> bool:
    return all(metric(w.url, "cacheflow_worker_requests") == 0 for w in local.workers)


def test_a_cancel_while_the_restore_runs_wins_and_frees_the_kv_on_every_stage(client, local):
    prefix = _stored_prefix(client, local, seed=1)
    created = client.post("/v1/restore", json={"token_ids": prefix, "policy": "load-only"}).json()
    assert created["cached_tokens"] == len(prefix), created
    rid = created["id"]
    wait_for(lambda: client.get(f"/v1/restore/{rid}").json()["state"] != "queued", "the restore admitted")
    assert client.get(f"/v1/restore/{rid}").json()["state"] == "restoring"  # the shaped links make it take seconds
    assert client.delete(f"/v1/restore/{rid}").json()["state"] == "cancelled"
    final = client.get(f"/v1/restore/{rid}", params={"wait": WAIT_S}).json()
    assert final["state"] == "cancelled", final
    for worker in local.workers:
        kv = httpx.get(f"{worker.url}/v1/requests/{rid}/kv", timeout=30,
                       headers=worker.granted_headers("read", request_id=rid, tenant=local.tenant))
        assert kv.status_code == 404
    assert _holding_nothing(local)
    assert metric(local.coordinator.url, "cacheflow_coordinator_slots_held") == 0


def test_a_streaming_client_that_leaves_before_its_first_token_stops_its_work_everywhere(client, local):
    prefix = _stored_prefix(client, local, seed=2)
    cancelled = [_cancelled_restores(w.url) for w in local.workers]
    busy = [_channel_busy(w.url) for w in local.workers]
    body = {"model": MODEL, "prompt": [*prefix, 5, 6], "max_tokens": 4, "stream": True, "policy": "load-only"}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        wait_for(lambda: _loading(local, busy), "every stage loading the prefix")
    # the client is gone, seconds before the restore could end: every stage stops it, and the slot is free
    wait_for(lambda: all(_cancelled_restores(w.url) > c for w, c in zip(local.workers, cancelled, strict=True)),
             "the restore cancelled on every stage")
    wait_for(lambda: metric(local.coordinator.url, "cacheflow_coordinator_slots_held") == 0, "the slot free")
    wait_for(lambda: _holding_nothing(local), "no KV held on any stage")
    later = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert later.status_code == 200, later.text


def _abandoned_requests(local: LocalCluster, body: dict[str, object], count: int) -> list[socket.socket]:
    """`count` requests sent on connections of their own, left open (close them to leave)."""
    raw = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {local.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n").encode()
    port = int(local.coordinator.url.rsplit(":", 1)[1])
    sockets = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(count)]
    for s in sockets:
        s.sendall(head + raw)
    return sockets


def _answered(url: str, status: str) -> float:
    return sum(value for labels, value in samples(url, "cacheflow_requests_total") if labels["status"] == status)


def test_clients_that_leave_before_a_whole_answer_free_their_slots_and_stop_their_work(client, local):
    prefix = _stored_prefix(client, local, seed=4)
    cancelled = [_cancelled_restores(w.url) for w in local.workers]
    busy = [_channel_busy(w.url) for w in local.workers]
    url = local.coordinator.url
    body = {"model": MODEL, "prompt": [*prefix, 7, 8], "max_tokens": 4, "policy": "load-only"}  # not streamed
    sockets = _abandoned_requests(local, body, MAX_BATCH + 2)
    try:
        wait_for(lambda: metric(url, "cacheflow_coordinator_slots_held") == MAX_BATCH
                 and metric(url, "cacheflow_queue_depth") == 2, "every slot held and two requests queued")
        wait_for(lambda: _loading(local, busy), "every stage loading the prefix")
    finally:
        for s in sockets:
            s.close()  # gone, seconds before the restores could end
    wait_for(lambda: metric(url, "cacheflow_queue_depth") == 0, "the queued requests out of the queue")
    wait_for(lambda: all(_cancelled_restores(w.url) >= c + MAX_BATCH for w, c in zip(local.workers, cancelled,
                                                                                       strict=True)),
             "the restores cancelled on every stage")
    wait_for(lambda: metric(url, "cacheflow_coordinator_slots_held") == 0, "every slot free")
    wait_for(lambda: _holding_nothing(local), "no KV held on any stage")
    wait_for(lambda: _answered(url, "499") == MAX_BATCH + 2, "every request counted as left by its client (499)")
    later = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2})
    assert later.status_code == 200, later.text


def test_readiness_fails_while_every_slot_is_held_too_long(client, local, tmp_path: Path):
    prefix = _stored_prefix(client, local, seed=3)
    narrow = second_coordinator(local, tmp_path, "--max-batch", "1", "--slot-stuck-s", "1")
    try:
        assert httpx.get(f"{narrow.url}/readyz").status_code == 200
        rid = post(narrow.url, local.token, "/v1/restore", {"token_ids": prefix, "policy": "load-only"}).json()["id"]
        wait_for(lambda: httpx.get(f"{narrow.url}/readyz").status_code == 503, "not ready while the slot is stuck")
        ready = httpx.get(f"{narrow.url}/readyz").json()
        assert ready["ready"] is False and all(s["up"] for s in ready["stages"])  # only the slots are wrong
        assert ready["slots"]["held"] == 1 and "held for more than 1 s" in ready["slots"]["stuck"], ready
        assert metric(narrow.url, "cacheflow_coordinator_slots_held") == 1
        assert (metric(narrow.url, "cacheflow_coordinator_oldest_slot_age_seconds") or 0) > 1
        httpx.delete(f"{narrow.url}/v1/restore/{rid}", headers={"Authorization": f"Bearer {local.token}"})
        wait_for(lambda: httpx.get(f"{narrow.url}/readyz").status_code == 200, "ready once the slot is free")
        assert metric(narrow.url, "cacheflow_coordinator_oldest_slot_age_seconds") == 0
    finally:
        narrow.stop()
