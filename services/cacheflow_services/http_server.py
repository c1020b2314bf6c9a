"""HTTP on both ends of every hop: a listening socket and a server for the services' APIs, and clients
to call them, all with `TCP_NODELAY`.

Why: with Nagle's algorithm on, a side that writes one message in two pieces (uvicorn writes a
response's head and body apart; httpx writes a request's headers and body apart) holds the second
piece back until the first is acknowledged, and the peer delays that acknowledgement by up to 40 ms.
Every keep-alive round trip then took ~44 ms instead of ~1 ms. asyncio turns Nagle off on accepted
sockets only when the listener was created with `proto=IPPROTO_TCP` (`socket.create_server` leaves it
0), and httpx never turns it off: so the listener is made here, and every client comes from here.
"""

from __future__ import annotations

import socket
from typing import Any

import httpx
import uvicorn

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # httpx's `socket_options`


def listen(host: str, port: int, *, backlog: int = 2048) -> socket.socket:
    """A listening TCP socket on (host, port) (port 0: any free one), whose accepted sockets asyncio
    sets `TCP_NODELAY` on (it does so only for sockets whose `proto` is IPPROTO_TCP)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          proto=socket.IPPROTO_TCP)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart on a port in TIME_WAIT
        sock.bind(address)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def http_server(app: Any) -> uvicorn.Server:
    """A uvicorn server for `app`; run it with `server.run(sockets=[listen(...)])`."""
    return uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))


def http_client(*, limits: httpx.Limits | None = None, **options: Any) -> httpx.Client:
    """An httpx client whose connections have `TCP_NODELAY`; `options` as httpx.Client's."""
    transport = httpx.HTTPTransport(limits=limits or httpx.Limits(), socket_options=NODELAY)
    return httpx.Client(transport=transport, **options)


def async_http_client(*, limits: httpx.Limits | None = None, **options: Any) -> httpx.AsyncClient:
    """An httpx async client whose connections have `TCP_NODELAY`; `options` as httpx.AsyncClient's."""
    transport = httpx.AsyncHTTPTransport(limits=limits or httpx.Limits(), socket_options=NODELAY)
    return httpx.AsyncClient(transport=transport, **options)
