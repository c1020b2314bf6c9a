"""A client of one storage pod's data plane: the `ChunkStore` interface over TCP (or NIXL, see `nixl_plane`).

Connections are pooled (one per concurrent caller) and authenticated once, by the hello. A pod that
cannot be reached, times out or drops the connection turns the read into a miss within `timeout_s`
(the restore recomputes the chunk) and is remembered as failed, so placement can route around it.
A pooled connection found broken (the pod restarted) is retried once on a fresh one. With `tls` (the
cluster CA's client context), every connection is TLS, the pod's certificate checked for its host name.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from cacheflow_common.errors import BadRequestError, ConfigError, StoreError, UnauthorizedError
from cacheflow_common.store.base import byte_views
from cacheflow_common.transport import wire
from cacheflow_common.transport.wire import Op, Status, WireError

log = logging.getLogger(__name__)
T = TypeVar("T")
_FAILURES = (OSError, WireError)  # socket errors and timeouts (TimeoutError is an OSError), broken protocol


@dataclass(frozen=True)
class PodAddress:
    pod_id: str  # stable identity for placement (the StatefulSet pod name); not the network address
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> PodAddress:
        """"id=host:port" or "host:port" (the id is then "host:port")."""
        pod_id, _, hostport = text.rpartition("=")
        host, sep, port = hostport.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"bad pod address {text!r}: expected [id=]host:port")
        return cls(pod_id or hostport, host, int(port))


class PodClient:
    def __init__(self, address: PodAddress, token: str, *, timeout_s: float = 5.0, nixl: Any = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.address = address
        self.name = f"pod({address.pod_id})"
        self.token = token
        self.timeout_s = timeout_s  # the longest a dead pod can hold a read before it becomes a miss
        self.nixl = nixl  # a nixl_plane.NixlClientEndpoint: bytes land by NIXL, requests still go over TCP
        self.tls = tls
        self.tenant = ""
        self.last_failure = -float("inf")  # monotonic time of the last unreachable/timeout
        self._pool: list[socket.socket] = []
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ connections
    def _connect(self) -> socket.socket:
        sock = socket.create_connection((self.address.host, self.address.port), timeout=self.timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.address.host)
            token = self.token.encode()
            sock.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, len(token)) + token)
            status, message, _ = wire.recv_response(sock)
            if status is Status.UNAUTHORIZED:
                raise UnauthorizedError(f"{self.name} refused our token: {message}")
            if status is not Status.OK:
                raise WireError(f"{self.name} refused the connection: {status.name} {message}")
            self.tenant = message
            if self.nixl is not None:
                self.nixl.introduce(sock)
            return sock
        except BaseException:
            sock.close()
            raise

    def _call(self, exchange: Callable[[socket.socket], T]) -> T:
        """One request/response on a pooled connection; a stale pooled one (not a timeout) is retried fresh."""
        with self._lock:
            sock = self._pool.pop() if self._pool else None
        if sock is not None:
            try:
                return self._exchange_on(sock, exchange)
            except TimeoutError:
                self.last_failure = time.monotonic()
                raise
            except _FAILURES:
                pass  # the pod closed it (restarted, or idle timeout): one more try on a new connection
        try:
            return self._exchange_on(self._connect(), exchange)
        except _FAILURES:
            self.last_failure = time.monotonic()
            raise

    def _exchange_on(self, sock: socket.socket, exchange: Callable[[socket.socket], T]) -> T:
        try:
            result = exchange(sock)
        except BaseException:
            sock.close()  # mid-request failure: the stream is out of step, never reuse it
            raise
        with self._lock:
            self._pool.append(sock)
        return result

    def failed_within(self, seconds: float) -> bool:
        return time.monotonic() - self.last_failure < seconds

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, []
        for sock in pool:
            sock.close()

    # ------------------------------------------------------------------------------------ ChunkStore
    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        return self.readv_into(name, [buf], offset)

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        out, length = byte_views(views)
        if self.nixl is not None:
            exchange = self.nixl.reader(name, out, length, offset)
        else:
            def exchange(sock: socket.socket) -> bool:
                sock.sendall(wire.pack_request(Op.GET, name, offset=offset, length=length))
                status, message, n = wire.recv_response(sock)
                if status is Status.OK:
                    if n != length:
                        raise WireError(f"asked for {length} bytes, the pod sends {n}")
                    wire.recv_exact_into_views(sock, out)  # straight into the reader's buffers
                    return True
                return self._refused_read(status, name, message)
        try:
            return bool(self._call(exchange))
        except _FAILURES as exc:
            log.info("%s: read of %s is a miss: %s", self.name, name, exc)
            return False

    def _refused_read(self, status: Status, name: str, message: str) -> bool:
        if status is Status.UNAUTHORIZED:
            raise UnauthorizedError(f"{self.name}: {message}")
        if status in (Status.BAD_REQUEST, Status.UNAVAILABLE):
            log.info("%s: read of %s refused (%s: %s)", self.name, name, status.name, message)
        return False  # MISS, CORRUPT and refusals are all misses to the reader

    def read(self, name: str) -> bytes | None:
        size = self.size(name)
        if size is None:
            return None
        buf = bytearray(size)
        return bytes(buf) if self.read_into(name, memoryview(buf)) else None

    def put(self, name: str, data: bytes | memoryview) -> None:
        body = memoryview(data).cast("B")

        def exchange(sock: socket.socket) -> None:
            sock.sendall(wire.pack_request(Op.PUT, name, length=len(body)))
            sock.sendall(body)
            status, message, _ = wire.recv_response(sock)
            if status is Status.BAD_REQUEST:
                raise BadRequestError(f"{self.name} refused {name}: {message}")
            if status is Status.UNAUTHORIZED:
                raise UnauthorizedError(f"{self.name}: {message}")
            if status is not Status.OK:
                raise StoreError(f"{self.name} could not store {name}: {message}")

        try:
            self._call(exchange)
        except _FAILURES as exc:
            raise StoreError(f"{self.name} unreachable while storing {name}: {exc}") from exc

    def size(self, name: str) -> int | None:
        def exchange(sock: socket.socket) -> int | None:
            sock.sendall(wire.pack_request(Op.STAT, name))
            status, message, _ = wire.recv_response(sock)
            if status is Status.OK:
                return int(message)
            self._refused_read(status, name, message)
            return None

        try:
            return self._call(exchange)
        except _FAILURES:
            return None

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def delete(self, name: str) -> None:
        def exchange(sock: socket.socket) -> None:
            sock.sendall(wire.pack_request(Op.DELETE, name))
            status, message, _ = wire.recv_response(sock)
            if status is not Status.OK:
                raise StoreError(f"{self.name} could not delete {name}: {status.name} {message}")

        try:
            self._call(exchange)
        except _FAILURES as exc:
            raise StoreError(f"{self.name} unreachable while deleting {name}: {exc}") from exc
