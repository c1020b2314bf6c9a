"""The NIXL data plane: the pod writes chunk bytes straight into the reader's registered memory.

Requests and answers still travel over the pod's TCP connection (`wire`); only the bytes move by
NIXL (UCX: shared memory on one host, RDMA or TCP across hosts). Metadata is exchanged over that same
connection (NIXL_HELLO), so no NIXL listener port is needed:

    client: register receive slots -> NIXL_HELLO(agent name, metadata) -> NIXL_GET(name, range, slot address)
            -> drive UCX until the answer comes -> copy the slot to where its bytes belong
    pod:    add the client's agent once -> read + verify into a registered staging slab ->
            WRITE slice by slice into the slot (each slice booked on the pod's token bucket) -> OK

Neither side runs a thread for NIXL: nothing spins while idle (see `_agent`).

The client's slots are registered before its metadata is sent (remote keys travel in the metadata),
so their number and size are fixed for the endpoint's life; a longer read is split into slot-sized
pieces, each copied into the caller's buffer after it lands.
"""

from __future__ import annotations

import contextlib
import queue
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

from cacheflow_common.errors import BadRequestError
from cacheflow_common.store.base import scatter, views_within
from cacheflow_common.transport import wire
from cacheflow_common.transport.shaping import TokenBucket
from cacheflow_common.transport.wire import Op, Status, WireError

_POLL_S = 20e-6  # between completion checks of a transfer in flight (the pod's side)
_PROGRESS_S = 1e-3  # the reader drives UCX this often while it waits for the pod's answer


def _agent(name: str) -> nixl_agent:
    """An agent with no thread of its own. No listener: metadata goes over our own connection. No
    progress thread: NIXL's polls its UCX worker with a zero timeout (its Python API fixes the delay at 0),
    a core at 100 % even with nothing to do; instead each side drives UCX only while a transfer of its
    own is in flight (the pod while it writes, the reader while it waits for the pod's answer). Several
    threads do so at once (a pod's connections, a process's readers), so the agent synchronizes its calls
    (without a progress thread NIXL would otherwise leave UCX single-threaded: concurrent readers missed)."""
    config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                               sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    return nixl_agent(name, config)


class RegisteredBuffer:
    """CPU memory registered with an agent: a uint8 tensor, its address and a writable byte view."""

    def __init__(self, agent: nixl_agent, nbytes: int) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8)  # [nbytes]
        self.agent = agent
        self.registration = agent.register_memory([self.tensor])
        self.nbytes = nbytes
        self.address = int(self.tensor.data_ptr())
        self.view = memoryview(self.tensor.numpy().data).cast("B")

    def release(self) -> None:
        self.agent.deregister_memory(self.registration)


def _run_transfer(agent: nixl_agent, op: str, local: tuple[int, int], remote: tuple[int, int], peer: str) -> bool:
    """One blocking NIXL transfer of `local` = (address, bytes) to/from `remote` on `peer`."""
    local_descs = agent.get_xfer_descs([(local[0], local[1], 0)], "DRAM")
    remote_descs = agent.get_xfer_descs([(remote[0], remote[1], 0)], "DRAM")
    handle = agent.initialize_xfer(op, local_descs, remote_descs, peer)
    try:
        state = agent.transfer(handle)
        while state == "PROC":
            time.sleep(_POLL_S)
            state = agent.check_xfer_state(handle)
        return state == "DONE"
    finally:
        agent.release_xfer_handle(handle)


class NixlPodEndpoint:
    """The pod's side: one agent, known client agents (ref-counted by connection), staging slabs."""

    def __init__(self, name: str) -> None:
        self.agent = _agent(name)
        self._peers: dict[str, int] = {}  # client agent name -> connections using it
        self._free: list[RegisteredBuffer] = []
        self._lock = threading.Lock()

    def add_peer(self, agent_name: str, metadata: bytes) -> str:
        with self._lock:
            if agent_name not in self._peers:
                try:
                    added = self.agent.add_remote_agent(metadata)
                except Exception as exc:  # nixl raises its own error types for bad metadata
                    raise BadRequestError(f"bad NIXL metadata: {exc}") from exc
                name = added.decode() if isinstance(added, bytes) else str(added)
                if name != agent_name:
                    self.agent.remove_remote_agent(name)
                    raise BadRequestError(f"NIXL metadata is for agent {name!r}, not {agent_name!r}")
                self._peers[agent_name] = 0
            self._peers[agent_name] += 1
        return agent_name

    def forget(self, agent_name: str) -> None:
        with self._lock:
            self._peers[agent_name] -= 1
            if self._peers[agent_name] == 0:
                del self._peers[agent_name]
                self.agent.remove_remote_agent(agent_name)

    @contextlib.contextmanager
    def staging(self, nbytes: int) -> Iterator[RegisteredBuffer]:
        """A registered slab of at least `nbytes`, reused across requests (one per concurrent request)."""
        with self._lock:
            fits = [b for b in self._free if b.nbytes >= nbytes]
            slab = min(fits, key=lambda b: b.nbytes) if fits else None
            if slab is not None:
                self._free.remove(slab)
        if slab is None:
            slab = RegisteredBuffer(self.agent, nbytes)
        try:
            yield slab
        finally:
            with self._lock:
                self._free.append(slab)

    def write_shaped(self, slab: RegisteredBuffer, peer: str, address: int, shaper: TokenBucket,
                     slices: list[tuple[int, int, float]]) -> bool:
        """WRITE the slab to `address` on `peer` slice by slice, each at its booked deadline."""
        for start, n, deadline in slices:
            shaper.wait(deadline)
            if not _run_transfer(self.agent, "WRITE", (slab.address + start, n), (address + start, n), peer):
                return False
        return True


class NixlClientEndpoint:
    """The reader's side: one agent per process and a fixed pool of registered receive slots."""

    def __init__(self, *, slots: int = 4, slot_bytes: int = 32 * 1024 * 1024) -> None:
        self.name = f"cacheflow-client-{uuid.uuid4().hex[:12]}"
        self.agent = _agent(self.name)
        self._slots: queue.Queue[RegisteredBuffer] = queue.Queue()
        for _ in range(slots):
            self._slots.put(RegisteredBuffer(self.agent, slot_bytes))
        self.slot_bytes = slot_bytes
        self.metadata: bytes = self.agent.get_agent_metadata()  # after registering: it carries the slots' keys

    def introduce(self, sock: socket.socket) -> None:
        """Tell the pod on `sock` about this agent (once per connection)."""
        sock.sendall(wire.pack_request(Op.NIXL_HELLO, self.name, length=len(self.metadata)) + self.metadata)
        status, message, _ = wire.recv_response(sock)
        if status is not Status.OK:
            raise WireError(f"the pod refused NIXL: {status.name} {message}")

    def reader(self, name: str, out: list[memoryview], length: int, offset: int) -> Callable[[socket.socket], bool]:
        """An exchange (for `PodClient`) that reads bytes [offset, offset + length) of `name` into the
        views `out`, one after another (each slot's bytes go straight to where they belong)."""

        def exchange(sock: socket.socket) -> bool:
            slot = self._slots.get()
            try:
                for start in range(0, length, self.slot_bytes):
                    n = min(self.slot_bytes, length - start)
                    sock.sendall(wire.pack_request(Op.NIXL_GET, name, offset=offset + start, length=n,
                                                   extra=slot.address))
                    self._progress_until_readable(sock)
                    status, _message, _ = wire.recv_response(sock)
                    if status is not Status.OK:
                        return False
                    scatter(slot.view[:n], views_within(out, start, n))
                return True
            finally:
                self._slots.put(slot)

        return exchange

    def _progress_until_readable(self, sock: socket.socket) -> None:
        """Drive this agent's UCX worker while the pod writes into our slot (it has no progress thread):
        until the pod's answer is on `sock`. Waiting on the socket, not spinning: the answer wakes it."""
        while not select.select([sock], [], [], _PROGRESS_S)[0]:
            self.agent.get_new_notifs()  # progresses the worker (NIXL does so for agents without a thread)
