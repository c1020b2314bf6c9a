"""The pod's bulk data plane: a threaded TCP server speaking `cacheflow_common.transport.wire`.

One thread per connection; each connection has its own staging buffer, so reads from many clients
proceed at once. Outgoing bytes are shaped by the pod's one token bucket in slices of `SLICE_BYTES`:
concurrent readers take turns slice by slice (FIFO bookings), so they share the link fairly and a
small read is not stuck behind a large one. With NIXL, the same connection carries the requests and
the pod writes the bytes straight into the client's registered memory (see `nixl_plane`).

The request protocol, per connection: hello (bearer token) -> tenant; then request -> response, in order.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from typing import Any

from cacheflow_common.errors import BadRequestError, StoreError
from cacheflow_common.transport import wire
from cacheflow_common.transport.shaping import TokenBucket
from cacheflow_common.transport.wire import Op, Status, WireError
from cacheflow_services.storage.pod import StoragePod

log = logging.getLogger(__name__)
SLICE_BYTES = 256 * 1024  # shaping granularity: 2 ms at 1 Gbit/s, fine enough for fair turns between readers
NIXL_SLICE_BYTES = 1024 * 1024  # for NIXL writes (a transfer's fixed cost is tens of microseconds)
MAX_NIXL_METADATA = 1 << 20  # bytes of a client agent's NIXL metadata


def send_shaped(sock: socket.socket, data: memoryview, shaper: TokenBucket,
                slices: list[tuple[int, int, float]]) -> None:
    """Send `data` slice by slice, each at its booked deadline (`TokenBucket.book_slices`)."""
    for start, n, deadline in slices:
        shaper.wait(deadline)
        sock.sendall(data[start : start + n])


class _Connection(socketserver.BaseRequestHandler):
    server: DataPlaneServer

    def setup(self) -> None:
        self.sock: socket.socket = self.request
        self.sock.settimeout(self.server.pod.config.io_timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.staging = bytearray()
        self.nixl_peer: Any = None  # the client's NIXL agent, after NIXL_HELLO

    def _buffer(self, n: int) -> memoryview:
        if len(self.staging) < n:
            self.staging = bytearray(n)  # grows to the largest request seen (bounded by max_object_bytes)
        return memoryview(self.staging)[:n]

    def handle(self) -> None:
        server = self.server
        if not server.admit():
            server.pod.metrics.refused.labels("connections").inc()
            wire.send_response(self.sock, Status.UNAVAILABLE, "too many connections")
            return
        try:
            tenant = self._hello()
            if tenant:
                while self._serve_one(tenant):
                    pass
        except (OSError, WireError) as exc:  # the client went away or broke the protocol: drop the connection
            log.debug("data connection from %s closed: %s", self.client_address, exc)
        finally:
            if self.nixl_peer is not None:
                server.nixl.forget(self.nixl_peer)
            server.leave()

    def _hello(self) -> str | None:
        magic, token_len = wire.HELLO.unpack(wire.recv_exact(self.sock, wire.HELLO.size))
        if magic != wire.HELLO_MAGIC or token_len > wire.MAX_TOKEN:
            wire.send_response(self.sock, Status.BAD_REQUEST, "not a CacheFlow data-plane hello")
            return None
        tenant = self.server.pod.tenant_of(wire.recv_exact(self.sock, token_len).decode(errors="replace"))
        if tenant is None:
            self.server.pod.metrics.refused.labels("unauthorized").inc()
            wire.send_response(self.sock, Status.UNAUTHORIZED, "missing or wrong bearer token")
            return None
        wire.send_response(self.sock, Status.OK, tenant)
        return tenant

    def _serve_one(self, tenant: str) -> bool:
        """Answer one request; False when the connection should close."""
        head = bytearray(wire.REQUEST.size)
        try:
            first = self.sock.recv_into(head)
        except TimeoutError:
            return False  # idle past the timeout between requests
        if first == 0:
            return False  # the client closed between requests
        wire.recv_exact_into(self.sock, memoryview(head)[first:])
        magic, op, _, name_len, offset, length, extra = wire.REQUEST.unpack(head)
        if magic != wire.REQUEST_MAGIC or name_len > wire.MAX_NAME:
            wire.send_response(self.sock, Status.BAD_REQUEST, "malformed request header")
            return False
        name = wire.recv_exact(self.sock, name_len).decode(errors="replace")
        try:
            return self._dispatch(tenant, Op(op), name, offset, length, extra)
        except ValueError:
            wire.send_response(self.sock, Status.BAD_REQUEST, f"unknown operation {op}")
            return op not in (Op.PUT, Op.NIXL_HELLO)  # those carry a body we did not read
        except BadRequestError as exc:
            wire.send_response(self.sock, Status.BAD_REQUEST, str(exc))
            return op not in (Op.PUT, Op.NIXL_HELLO)  # refused before its body was read: cannot resync
        except StoreError as exc:
            wire.send_response(self.sock, Status.UNAVAILABLE, str(exc))
            return True

    def _dispatch(self, tenant: str, op: Op, name: str, offset: int, length: int, extra: int) -> bool:
        pod = self.server.pod
        if op is Op.GET:
            pod.check_length(length, "a read")
            out = self._buffer(length)
            slices = self.server.shaper.book_slices(length, SLICE_BYTES)
            status, reason = pod.read(tenant, name, offset, out)
            if status is not Status.OK:
                self.server.shaper.release(slices[-1][2], length)
                wire.send_response(self.sock, status, reason)
                return True
            wire.send_response(self.sock, Status.OK, "", length)
            send_shaped(self.sock, out, self.server.shaper, slices)
        elif op is Op.PUT:
            pod.check_length(length, "an object")
            body = self._buffer(length)
            wire.recv_exact_into(self.sock, body)
            try:
                status, reason = pod.write(tenant, name, body)
            except BadRequestError as exc:  # the body was read: the connection stays usable
                status, reason = Status.BAD_REQUEST, str(exc)
            wire.send_response(self.sock, status, reason)
        elif op is Op.STAT:
            size = pod.size(tenant, name)
            wire.send_response(self.sock, *((Status.OK, str(size)) if size is not None else (Status.MISS, "absent")))
        elif op is Op.DELETE:
            pod.delete(tenant, name)
            wire.send_response(self.sock, Status.OK)
        elif op is Op.NIXL_HELLO:
            self._nixl_hello(name, length)
        else:  # NIXL_GET
            self._nixl_get(tenant, name, offset, length, extra)
        return True

    def _nixl_hello(self, agent_name: str, length: int) -> None:
        if self.server.nixl is None:
            raise BadRequestError("this pod serves TCP only (NIXL is off or unavailable)")
        if not 0 < length <= MAX_NIXL_METADATA:
            raise BadRequestError(f"NIXL metadata of {length} bytes")
        metadata = wire.recv_exact(self.sock, length)
        if self.nixl_peer is not None:
            self.server.nixl.forget(self.nixl_peer)
        self.nixl_peer = self.server.nixl.add_peer(agent_name, metadata)
        wire.send_response(self.sock, Status.OK)

    def _nixl_get(self, tenant: str, name: str, offset: int, length: int, address: int) -> None:
        nixl = self.server.nixl
        if nixl is None or self.nixl_peer is None:
            raise BadRequestError("NIXL_GET before NIXL_HELLO (or NIXL is off on this pod)")
        self.server.pod.check_length(length, "a read")
        with nixl.staging(length) as slab:
            slices = self.server.shaper.book_slices(length, NIXL_SLICE_BYTES)
            status, reason = self.server.pod.read(tenant, name, offset, slab.view[:length])
            if status is not Status.OK:
                self.server.shaper.release(slices[-1][2], length)
            else:
                ok = nixl.write_shaped(slab, self.nixl_peer, address, self.server.shaper, slices)
                status, reason = (Status.OK, "") if ok else (Status.UNAVAILABLE, "NIXL transfer failed")
        wire.send_response(self.sock, status, reason)


class DataPlaneServer(socketserver.ThreadingTCPServer):
    daemon_threads = True  # connection threads never keep the process alive
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, pod: StoragePod, shaper: TokenBucket, nixl: Any = None) -> None:
        self.pod = pod
        self.shaper = shaper
        self.nixl = nixl  # a nixl_plane.NixlPodEndpoint, or None for TCP only
        self._open = 0
        self._open_lock = threading.Lock()
        super().__init__((pod.config.host, pod.config.data_port), _Connection)

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def admit(self) -> bool:
        with self._open_lock:
            if self._open >= self.pod.config.max_connections:
                return False
            self._open += 1
            self.pod.metrics.connections.set(self._open)
            return True

    def leave(self) -> None:
        with self._open_lock:
            self._open -= 1
            self.pod.metrics.connections.set(self._open)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="data-plane", daemon=True)
        thread.start()
        return thread
