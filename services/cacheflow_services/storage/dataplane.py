"""The pod's bulk data plane: a threaded TCP server speaking `cacheflow_common.transport.wire`.

One thread per connection. Outgoing bytes are shaped by the pod's one token bucket in slices of
`SLICE_BYTES`: concurrent readers take turns slice by slice (FIFO bookings), so they share the link
fairly and a small read is not stuck behind a large one. With NIXL, the same connection carries the
requests and the pod writes the bytes straight into the client's registered memory (see `nixl_plane`).

Memory: nothing is allocated for a request before it needs it. A read is streamed in checked pieces
through one bounded buffer (`reads`), only once the object is known to hold the range; a PUT body
grows as its bytes arrive. Both count against the pod's `BufferBudget` (`max_buffered_bytes`).

The request protocol, per connection: hello (bearer token) -> tenant; then request -> response, in
order. The hello must be complete within `hello_timeout_s`, and `ConnectionGate` caps connections
(pending, per tenant, in all); a connection idle for `idle_timeout_s` between requests is closed, and
so is one whose credential has expired when its next request arrives.

TLS (`tls`: the pod's server context): a connection that opens with a TLS handshake is served over
TLS (the workers' always are, where the cluster has TLS); one that opens with the plain hello is served
plain, for clients that hold a tenant's token and no CA (the vLLM connector).
"""

from __future__ import annotations

import logging
import socket
import socketserver
import ssl
import threading
import time
from typing import Any

from cacheflow_common.auth import pod_credential_expiry
from cacheflow_common.errors import BadRequestError, StoreError
from cacheflow_common.transport import wire
from cacheflow_common.transport.shaping import TokenBucket
from cacheflow_common.transport.wire import Op, Status, WireError
from cacheflow_services.storage.admission import ConnectionGate
from cacheflow_services.storage.pod import StoragePod
from cacheflow_services.storage.reads import ReadPlan, slices_within

log = logging.getLogger(__name__)
SLICE_BYTES = 256 * 1024  # shaping granularity: 2 ms at 1 Gbit/s, fine enough for fair turns between readers
NIXL_SLICE_BYTES = 1024 * 1024  # for NIXL writes (a transfer's fixed cost is tens of microseconds)
NIXL_PIECE_BYTES = 4 * 1024 * 1024  # NIXL reads stream through a registered slab of about this size
MAX_NIXL_METADATA = 1 << 20  # bytes of a client agent's NIXL metadata
SKIP_BYTES = 64 * 1024  # a refused PUT body is read and dropped this much at a time
TLS_HANDSHAKE = b"\x16"  # a TLS record of type handshake: how a TLS connection's first byte reads


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
        self.config = self.server.pod.config
        self.sock.settimeout(self.config.io_timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.tenant = ""  # set once the hello is accepted
        self.valid_until = float("inf")  # unix time: a worker's pod credential expires, and its connection with it
        self.nixl_peer: Any = None  # the client's NIXL agent, after NIXL_HELLO

    def handle(self) -> None:
        server = self.server
        server.gate.arrive(self.sock)
        try:
            secured = server.secured(self.sock)
            server.gate.replace(self.sock, secured)
            self.sock = secured
            if self._hello():
                while self._serve_one():
                    pass
        except (OSError, WireError) as exc:  # the client went away, was too slow or broke the protocol: drop it
            log.debug("data connection from %s closed: %s", self.client_address, exc)
        finally:
            if self.nixl_peer is not None:
                server.nixl.forget(self.nixl_peer)
            server.gate.leave(self.sock, self.tenant)

    def _hello(self) -> bool:
        deadline = time.monotonic() + self.config.hello_timeout_s
        try:
            magic, token_len = wire.HELLO.unpack(wire.recv_exact(self.sock, wire.HELLO.size, deadline))
            if magic != wire.HELLO_MAGIC or token_len > wire.MAX_TOKEN:
                wire.send_response(self.sock, Status.BAD_REQUEST, "not a CacheFlow data-plane hello")
                return False
            token = wire.recv_exact(self.sock, token_len, deadline).decode(errors="replace")
        except TimeoutError:
            self.server.pod.metrics.refused.labels("hello_timeout").inc()
            raise
        tenant = self.server.pod.tenant_of(token)
        if tenant is None:
            self.server.pod.metrics.refused.labels("unauthorized").inc()
            wire.send_response(self.sock, Status.UNAUTHORIZED, "missing or wrong bearer token")
            return False
        refused = self.server.gate.authenticate(self.sock, tenant)
        if refused:
            wire.send_response(self.sock, Status.UNAVAILABLE, refused)
            return False
        self.tenant = tenant
        self.valid_until = pod_credential_expiry(token)
        wire.send_response(self.sock, Status.OK, tenant)
        return True

    def _wait_for_request(self, head: bytearray) -> int:
        """Bytes of the next request's header received (0: the client closed, or stayed idle too long)."""
        self.sock.settimeout(self.config.idle_timeout_s)
        try:
            return self.sock.recv_into(head)
        except TimeoutError:
            return 0  # idle past the timeout between requests: closed (the client's pool reconnects)
        finally:
            self.sock.settimeout(self.config.io_timeout_s)

    def _serve_one(self) -> bool:
        """Answer one request; False when the connection should close (also once its credential expired:
        the client's pool reconnects with a fresh one)."""
        if time.time() > self.valid_until:
            return False
        head = bytearray(wire.REQUEST.size)
        first = self._wait_for_request(head)
        if first == 0:
            return False
        if time.time() > self.valid_until:  # it expired while the connection waited: not one more request
            wire.send_response(self.sock, Status.UNAUTHORIZED, "the credential of this connection has expired")
            return False
        deadline = time.monotonic() + self.config.io_timeout_s  # the rest of the header and the name
        wire.recv_exact_into(self.sock, memoryview(head)[first:], deadline)
        magic, op, _, name_len, offset, length, extra = wire.REQUEST.unpack(head)
        if magic != wire.REQUEST_MAGIC or name_len > wire.MAX_NAME:
            wire.send_response(self.sock, Status.BAD_REQUEST, "malformed request header")
            return False
        name = wire.recv_exact(self.sock, name_len, deadline).decode(errors="replace")
        if op not in set(Op):
            wire.send_response(self.sock, Status.BAD_REQUEST, f"unknown operation {op}")
            return True
        try:
            self._dispatch(Op(op), name, offset, length, extra)
            return True
        except BadRequestError as exc:
            wire.send_response(self.sock, Status.BAD_REQUEST, str(exc))
            return op not in (Op.PUT, Op.NIXL_HELLO)  # refused before its body was read: cannot resync
        except StoreError as exc:
            wire.send_response(self.sock, Status.UNAVAILABLE, str(exc))
            return True

    def _dispatch(self, op: Op, name: str, offset: int, length: int, extra: int) -> None:
        pod = self.server.pod
        if op is Op.GET:
            self._get(name, offset, length)
        elif op is Op.PUT:
            self._put(name, length)
        elif op is Op.STAT:
            size = pod.size(self.tenant, name)
            wire.send_response(self.sock, *((Status.OK, str(size)) if size is not None else (Status.MISS, "absent")))
        elif op is Op.DELETE:
            pod.delete(self.tenant, name)
            wire.send_response(self.sock, Status.OK)
        elif op is Op.NIXL_HELLO:
            self._nixl_hello(name, length)
        else:  # NIXL_GET
            self._nixl_get(name, offset, length, extra)

    # ------------------------------------------------------------------------------------ TCP reads
    def _get(self, name: str, offset: int, length: int) -> None:
        pod, shaper = self.server.pod, self.server.shaper
        plan = pod.plan_read(self.tenant, name, offset, length)
        if not isinstance(plan, ReadPlan):  # a miss: nothing allocated, nothing booked
            wire.send_response(self.sock, *plan)
            return
        size = plan.buffer_bytes()
        with pod.buffers.reserved(size, self.config.io_timeout_s):
            buf = memoryview(bytearray(size))
            slices = shaper.book_slices(length, SLICE_BYTES)
            status, reason = self._stream(plan, buf, slices)
        if status is Status.OK:
            pod.count_hit(plan)
        else:
            shaper.release(slices[-1][2], length)
            wire.send_response(self.sock, status, reason)

    def _stream(self, plan: ReadPlan, buf: memoryview, slices: list[tuple[int, int, float]]) -> tuple[Status, str]:
        """Send the plan's bytes piece by piece, each checked first; a refusal found before the first byte
        is returned (to answer instead), one found later cuts the connection (the reader sees a miss)."""
        sent = False
        for start, n in plan.pieces():
            status, reason = self.server.pod.read_piece(plan, start, buf[:n])
            if status is not Status.OK:
                if sent:
                    raise WireError(f"{plan.stored} turned {status.name} mid-read ({reason}): connection cut")
                return status, reason
            if not sent:
                wire.send_response(self.sock, Status.OK, "", plan.length)
                sent = True
            send_shaped(self.sock, buf[:n], self.server.shaper, slices_within(slices, start, n))
        return Status.OK, ""

    # ------------------------------------------------------------------------------------ writes
    def _put(self, name: str, length: int) -> None:
        pod = self.server.pod
        pod.check_length(length, "an object")
        with pod.buffers.growing(self.config.io_timeout_s) as body:
            try:
                while len(body.data) < length:
                    body.append(self._recv_some(body.room(length - len(body.data))))
            except StoreError as exc:  # no room in the pod's buffers: drop the rest, the connection stays usable
                self._skip(length - len(body.data))
                wire.send_response(self.sock, Status.UNAVAILABLE, str(exc))
                return
            try:
                status, reason = pod.write(self.tenant, name, memoryview(body.data))
            except BadRequestError as exc:  # the body was read: the connection stays usable
                status, reason = Status.BAD_REQUEST, str(exc)
        wire.send_response(self.sock, status, reason)

    def _recv_some(self, limit: int) -> bytes:
        """Up to `limit` bytes, as soon as some arrive (memory is only touched for bytes received)."""
        data = self.sock.recv(limit)
        if not data:
            raise WireError("connection closed mid-message")
        return data

    def _skip(self, n: int) -> None:
        while n > 0:
            n -= len(self._recv_some(min(n, SKIP_BYTES)))

    # ------------------------------------------------------------------------------------ NIXL
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

    def _nixl_get(self, name: str, offset: int, length: int, address: int) -> None:
        nixl, pod, shaper = self.server.nixl, self.server.pod, self.server.shaper
        if nixl is None or self.nixl_peer is None:
            raise BadRequestError("NIXL_GET before NIXL_HELLO (or NIXL is off on this pod)")
        plan = pod.plan_read(self.tenant, name, offset, length)
        if not isinstance(plan, ReadPlan):
            wire.send_response(self.sock, *plan)
            return
        size = plan.buffer_bytes(NIXL_PIECE_BYTES)
        with pod.buffers.reserved(size, self.config.io_timeout_s), nixl.staging(size) as slab:
            slices = shaper.book_slices(length, NIXL_SLICE_BYTES)
            status, reason = Status.OK, ""
            for start, n in plan.pieces(NIXL_PIECE_BYTES):
                status, reason = pod.read_piece(plan, start, slab.view[:n])
                if status is Status.OK and not nixl.write_shaped(slab, self.nixl_peer, address + start, shaper,
                                                                 slices_within(slices, start, n)):
                    status, reason = Status.UNAVAILABLE, "NIXL transfer failed"
                if status is not Status.OK:
                    break
        if status is Status.OK:
            pod.count_hit(plan)
        else:
            shaper.release(slices[-1][2], length)
        wire.send_response(self.sock, status, reason)


class DataPlaneServer(socketserver.ThreadingTCPServer):
    daemon_threads = True  # connection threads never keep the process alive
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, pod: StoragePod, shaper: TokenBucket, nixl: Any = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.pod = pod
        self.shaper = shaper
        self.nixl = nixl  # a nixl_plane.NixlPodEndpoint, or None for TCP only
        self.tls = tls  # the pod's TLS server context, or None: plain TCP only
        self.gate = ConnectionGate(pod.config, pod.metrics)
        super().__init__((pod.config.host, pod.config.data_port), _Connection)

    def secured(self, sock: socket.socket) -> socket.socket:
        """`sock`, in TLS when its first byte opens a TLS handshake (and the pod has TLS); the handshake
        must end within the hello timeout."""
        if self.tls is None:
            return sock
        sock.settimeout(self.pod.config.hello_timeout_s)
        if sock.recv(1, socket.MSG_PEEK) != TLS_HANDSHAKE:
            sock.settimeout(self.pod.config.io_timeout_s)
            return sock
        secure = self.tls.wrap_socket(sock, server_side=True)
        secure.settimeout(self.pod.config.io_timeout_s)
        return secure

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.serve_forever, name="data-plane", daemon=True)
        thread.start()
        return thread
