"""The chaos bench's second-pass probes (issue 43): slowloris on the coordinator's public port, one tenant
filling the workers' KV pools while another is served, and requests after idle keep-alive gaps.

* `slowloris`: connections that send a request head one byte a second and never finish it; how long the
  last of them stayed open (the server's header timeout closes them).
* `fill_pools`: tenant `hog` takes every KV block its pool share allows on every worker (restores granted as
  the coordinator would, each reserving a big room), then the other tenant's replay runs; what it got
  refused, and what the coordinator's /readyz said meanwhile.
* `idle_requests`: one request after each idle gap around the old 5 s server keep-alive (the race that made
  the coordinator redo a restore): failed requests, and restores a worker failed meanwhile (a redo's trace).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx

from cacheflow_common.auth import GRANT_HEADER, input_digest
from cacheflow_services.local_cluster import LocalCluster

SLOW_CONNECTIONS, SLOW_LIMIT_S = 200, 30.0
HOG, HOG_TOKENS = "hog", 4096  # the filling tenant, and the room each of its restores reserves
IDLE_GAPS_S = (4.9, 5.0, 5.1, 5.2, 6.0)


def slowloris(url: str) -> dict[str, Any]:
    host, port = url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    for _ in range(SLOW_CONNECTIONS):
        with contextlib.suppress(OSError):
            sock = socket.create_connection((host, int(port)), timeout=2)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            sock.setblocking(False)
            socks.append(sock)
    began, open_ = time.monotonic(), set(socks)
    while open_ and time.monotonic() - began < SLOW_LIMIT_S:
        for sock in list(open_):
            try:
                if sock.recv(1) == b"":
                    open_.discard(sock)
                    continue
            except BlockingIOError:
                pass
            except OSError:
                open_.discard(sock)
                continue
            with contextlib.suppress(OSError):
                sock.send(b"X")  # one more byte of a header line that never ends
        time.sleep(1.0)
    last = time.monotonic() - began
    for sock in socks:
        sock.close()
    return {"connections": len(socks), "still_open": len(open_), "open_after_s": round(last, 1)}


def fill_pools(cluster: LocalCluster, pod_tokens: dict[str, str], send: Callable[[], list[dict[str, Any]]]
               ) -> dict[str, Any]:
    held: list[tuple[int, str]] = []
    for worker in cluster.workers:
        issuer = worker.issuer(pod_tokens)
        for i in range(10_000):
            rid, tokens = f"hog-{worker.stage}-{i}", [1 + i % 1000] * 64
            grant = issuer.issue("restore", stages=[worker.stage], request_id=rid, tenant=HOG, max_tokens=HOG_TOKENS,
                                 digest=input_digest(tokens, reserve=HOG_TOKENS - len(tokens)))
            body = {"request_id": rid, "tenant": HOG, "token_ids": tokens, "reserve_tokens": HOG_TOKENS - len(tokens),
                    "policy": "compute-only"}
            answer = httpx.post(f"{worker.url}/v1/restore", json=body, timeout=120,
                                headers={**worker.internal_headers, GRANT_HEADER: grant})
            if answer.status_code != 200:
                break  # its share is full (503)
            held.append((worker.stage, rid))
    time.sleep(3.0)  # the coordinator's health probe sees the pools
    readyz = httpx.get(f"{cluster.coordinator.url}/readyz", timeout=30).status_code
    outcomes = send()
    for stage, rid in held:
        worker = cluster.workers[stage]
        httpx.delete(f"{worker.url}/v1/requests/{rid}", timeout=30,
                     headers=worker.granted_headers("release", request_id=rid, tenant=HOG))
    return {"hog_requests_held": len(held), "outcomes": outcomes, "coordinator_readyz": readyz,
            "refused": sum("error" in r for r in outcomes)}


def idle_requests(cluster: LocalCluster, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {cluster.token}"}
    before = _restore_failures(cluster)
    failed = 0
    with httpx.Client(base_url=cluster.coordinator.url, headers=headers, timeout=120) as client:
        client.post("/v1/completions", json=body)
        for gap in IDLE_GAPS_S:
            time.sleep(gap)
            failed += client.post("/v1/completions", json=body).status_code != 200
    return {"gaps_s": list(IDLE_GAPS_S), "failed": failed, "restores_redone": _restore_failures(cluster) - before}


def _restore_failures(cluster: LocalCluster) -> int:
    total = 0.0
    for worker in cluster.workers:
        text = httpx.get(f"{worker.url}/metrics", timeout=30).text
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("cacheflow_worker_restore_failures_total"))
    return int(total)
