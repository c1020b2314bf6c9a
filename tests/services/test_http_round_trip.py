"""No hop stalls on Nagle's algorithm meeting a delayed ACK (~40 ms a round trip on Linux).

The mechanism is checked directly: asyncio (and so uvicorn) turns `TCP_NODELAY` on for sockets
accepted from our listener, and not for a `socket.create_server` one (what the services used before).
Then the effect, on a real service process: the *fastest* of several keep-alive round trips is far
below the stall. A stall is not noise: with Nagle on, every keep-alive round trip paid it, so even the
fastest one took ~44 ms, whatever else ran on the machine; the bound is 20 ms.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from cacheflow_services.http_server import http_client, listen
from tests.services.procs import Pod, start_pod

STALL_S = 0.020  # half the delayed-ACK timer: a round trip that paid it is never faster
ROUND_TRIPS = 15


async def _accepted_nodelay(listener: socket.socket) -> int:
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connect(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=listener)
    port = listener.getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        return await asyncio.wait_for(seen, 10)
    finally:
        writer.close()
        server.close()


def test_asyncio_sets_nodelay_on_connections_accepted_from_our_listener():
    assert asyncio.run(_accepted_nodelay(listen("127.0.0.1", 0))) != 0
    # what the services did before: asyncio leaves Nagle on (proto 0 is not IPPROTO_TCP to it)
    assert asyncio.run(_accepted_nodelay(socket.create_server(("127.0.0.1", 0)))) == 0


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    p = start_pod(tmp_path_factory.mktemp("pod"))
    yield p
    p.stop()


def _fastest(call: Callable[[], httpx.Response]) -> float:
    call().raise_for_status()  # connect (a new connection ACKs quickly: only keep-alive ones stall)
    times = []
    for _ in range(ROUND_TRIPS):
        began = time.perf_counter()
        call().raise_for_status()
        times.append(time.perf_counter() - began)
    return min(times)


def test_keep_alive_round_trips_to_a_service_do_not_stall(pod: Pod):
    # a GET is one write from any client: only the server's side can stall it
    with httpx.Client(timeout=30) as plain:
        assert _fastest(lambda: plain.get(pod.url("/v1/stats"), headers=pod.headers())) < STALL_S
    # a POST is two writes (headers, body) from httpx: our clients turn Nagle off too
    with http_client(timeout=30, headers=pod.headers()) as ours:
        assert _fastest(lambda: ours.post(pod.url("/v1/chunks/exists"), json={"names": ["x" * 64]})) < STALL_S
