"""Requests restoring at once through one StageChain reach the stages at once (not one after another).

The stages here are loopback HTTP servers that answer `/v1/restore` only once every expected call is
in flight together (a barrier); real stage workers are tested in test_workers.py. A chain that
queued one request's stage calls behind another's breaks the barrier and the restores fail.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cacheflow_common.auth import GrantIssuer, ensure_cluster_secrets
from cacheflow_services.coordinator.stage_chain import StageChain

STAGES, REQUESTS = 2, 6


def _barrier_stage(barrier: threading.Barrier) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                barrier.wait()
                status, answer = 200, {"request_id": body["request_id"], "stage": 0, "input": "boundary",
                                       "policy": "cake", "mode": "token", "elapsed_s": 0.0, "computed": 0, "loaded": 0}
            except threading.BrokenBarrierError:
                status, answer = 503, {"detail": "not every restore was in flight at once"}
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def stage_urls() -> Iterator[list[str]]:
    barrier = threading.Barrier(STAGES * REQUESTS, timeout=10)
    servers = [_barrier_stage(barrier) for _ in range(STAGES)]
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for server in servers:
        server.shutdown()
        server.server_close()


def _issuer(tmp_path: Path) -> GrantIssuer:
    return GrantIssuer.from_dir(ensure_cluster_secrets(tmp_path), {"t": "pod-token"})


def test_every_stage_call_of_every_request_is_in_flight_at_once(stage_urls, tmp_path):
    chain = StageChain(stage_urls, issuer=_issuer(tmp_path), timeout_s=30, max_requests=REQUESTS)
    try:
        with ThreadPoolExecutor(REQUESTS) as clients:
            results = list(clients.map(lambda i: chain.restore(f"r{i}", [1, 2, 3], tenant="t", input="boundary"),
                                       range(REQUESTS)))
    finally:
        chain.close()
    assert [[stage.request_id for stage in r] for r in results] == [[f"r{i}"] * STAGES for i in range(REQUESTS)]


def test_the_stage_calls_share_one_thread_not_one_per_stage_per_request(stage_urls, tmp_path):
    before = set(threading.enumerate())  # other tests' chains may still be alive in this process
    chain = StageChain(stage_urls, issuer=_issuer(tmp_path), timeout_s=30, max_requests=REQUESTS)
    try:
        with ThreadPoolExecutor(REQUESTS) as clients:
            list(clients.map(lambda i: chain.restore(f"r{i}", [1, 2, 3], tenant="t", input="boundary"),
                             range(REQUESTS)))
        started_by_chain = [t for t in set(threading.enumerate()) - before if t.name == "stage-calls"]
        assert len(started_by_chain) == 1  # the event loop every restore call of every request runs on
    finally:
        chain.close()
