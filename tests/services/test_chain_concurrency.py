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

import pytest

from cacheflow_services.worker.chain import StageChain

STAGES, REQUESTS = 2, 6


def _barrier_stage(barrier: threading.Barrier) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                barrier.wait()
                status, answer = 200, {"stage": 0, "request": body["request_id"]}
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


def test_every_stage_call_of_every_request_is_in_flight_at_once(stage_urls):
    chain = StageChain(stage_urls, timeout_s=30, max_requests=REQUESTS)
    try:
        with ThreadPoolExecutor(REQUESTS) as clients:
            results = list(clients.map(lambda i: chain.restore(f"r{i}", [1, 2, 3], tenant="t", input="boundary"),
                                       range(REQUESTS)))
    finally:
        chain.close()
    assert [[stage["request"] for stage in r] for r in results] == [[f"r{i}"] * STAGES for i in range(REQUESTS)]
