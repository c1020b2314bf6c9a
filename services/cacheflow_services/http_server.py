"""HTTP on both ends of every hop: a listening socket and a server for the services' APIs, and clients
to call them, all with `TCP_NODELAY`, TLS where the cluster has it, and limits that hold nothing for
strangers.

Why `TCP_NODELAY`: with Nagle's algorithm on, a side that writes one message in two pieces (uvicorn writes
a response's head and body apart; httpx writes a request's headers and body apart) holds the second
piece back until the first is acknowledged, and the peer delays that acknowledgement by up to 40 ms.
Every keep-alive round trip then took ~44 ms instead of ~1 ms. asyncio turns Nagle off on accepted
sockets only when the listener was created with `proto=IPPROTO_TCP` (`socket.create_server` leaves it
0), and httpx never turns it off: so the listener is made here, and every client comes from here.

What a server holds for a connection (`ServerLimits`): its request's headers must be complete within
`header_timeout_s` of their first byte (or of the connection), and its body must keep coming (no gap
over `body_timeout_s`), else the connection is closed (slowloris); one client address has at most
`max_connections_per_client` open at once (more are closed at once). Idle keep-alive connections live
`SERVER_KEEP_ALIVE_S`; clients drop theirs after `CLIENT_KEEP_ALIVE_S`, shorter, so a client never
sends on a connection the server is closing, and a call whose connection (not its server) failed is
sent once more (`retry_on_stale_connection`).
"""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import h11
import httpx
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from cacheflow_common.tls import TLSFiles

NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]  # httpx's `socket_options`
SERVER_KEEP_ALIVE_S = 75.0  # an idle keep-alive connection is closed by the server after this ...
CLIENT_KEEP_ALIVE_S = 30.0  # ... and by the client after this, well before
# the connection failed, not the server's work: nothing was answered on it (a stale keep-alive connection)
CONNECTION_FAILURES = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
T = TypeVar("T")


@dataclass(frozen=True)
class ServerLimits:
    """What one HTTP port holds for a client (`guarded_protocol`)."""

    header_timeout_s: float = 5.0
    body_timeout_s: float = 30.0  # the longest gap between two pieces of a request's body
    max_connections_per_client: int = 512  # above every pool of the cluster's own clients (coordinator: 2 x 64 x 2)


DEFAULT_LIMITS = ServerLimits()


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


def http_server(app: Any, *, tls: TLSFiles | None = None, limits: ServerLimits = DEFAULT_LIMITS) -> uvicorn.Server:
    """A uvicorn server for `app` (HTTPS with `tls`); run it with `server.run(sockets=[listen(...)])`."""
    # our TLS context, not uvicorn's: it reloads a renewed certificate
    context = None if tls is None else (lambda _config, _default: tls.server_context())
    config = uvicorn.Config(app, log_level="warning", access_log=False, http=guarded_protocol(limits),
                            timeout_keep_alive=int(SERVER_KEEP_ALIVE_S), ssl_context_factory=context)
    return uvicorn.Server(config)


def guarded_protocol(limits: ServerLimits) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol with `limits`' timeouts and per-client connection cap (one count per server)."""
    open_by_client: Counter[str] = Counter()

    class GuardedProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _counted = ""

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else ""
            if open_by_client[host] >= limits.max_connections_per_client:
                transport.close()  # connection_lost follows; nothing was counted for it
                return
            open_by_client[host] += 1
            self._counted = host or "?"
            self._arm(limits.header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if self._counted:
                host = "" if self._counted == "?" else self._counted
                open_by_client[host] -= 1
                if open_by_client[host] <= 0:
                    del open_by_client[host]
                self._counted = ""
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            state = self.conn.their_state
            if state is h11.IDLE:  # a request's head in progress: its clock runs from its first byte, not reset
                if self._deadline is None:
                    self._arm(limits.header_timeout_s)
            elif state is h11.SEND_BODY:
                self._arm(limits.body_timeout_s)  # a gap between two pieces of the body
            else:
                self._disarm()  # the request is whole: the app answers it

        def on_response_complete(self) -> None:
            self._disarm()  # idle now: the keep-alive timeout governs until the next request's first byte
            super().on_response_complete()

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


def _verify(tls: TLSFiles | None) -> Any:
    return tls.client_context() if tls is not None else True


def http_client(*, limits: httpx.Limits | None = None, tls: TLSFiles | None = None, **options: Any) -> httpx.Client:
    """An httpx client whose connections have `TCP_NODELAY`, expire idle before the servers' do, and trust
    the cluster CA with `tls`; `options` as httpx.Client's."""
    transport = httpx.HTTPTransport(limits=_keep_alive(limits), socket_options=NODELAY, verify=_verify(tls))
    return httpx.Client(transport=transport, **options)


def async_http_client(*, limits: httpx.Limits | None = None, tls: TLSFiles | None = None,
                      **options: Any) -> httpx.AsyncClient:
    """`http_client`'s async twin."""
    transport = httpx.AsyncHTTPTransport(limits=_keep_alive(limits), socket_options=NODELAY, verify=_verify(tls))
    return httpx.AsyncClient(transport=transport, **options)


def _keep_alive(limits: httpx.Limits | None) -> httpx.Limits:
    given = limits or httpx.Limits()
    return httpx.Limits(max_connections=given.max_connections,
                        max_keepalive_connections=given.max_keepalive_connections, keepalive_expiry=CLIENT_KEEP_ALIVE_S)


def retry_on_stale_connection(call: Callable[[], T]) -> T:
    """`call()`, sent once more when its connection failed before an answer (the server closed an idle
    connection as the request went out): not when the server refused, failed or was too slow."""
    try:
        return call()
    except CONNECTION_FAILURES:
        return call()


async def aretry_on_stale_connection(call: Callable[[], Any]) -> Any:
    """`retry_on_stale_connection` for a coroutine function."""
    try:
        return await call()
    except CONNECTION_FAILURES:
        return await call()
