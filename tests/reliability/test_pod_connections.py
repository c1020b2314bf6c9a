"""A storage pod's data port cannot be held by sockets without a token, nor filled by one tenant
(real pod processes on loopback; no assertion on speed, every wait bounded generously)."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx

from cacheflow_common.transport import wire
from cacheflow_common.transport.pod_client import PodClient
from tests.services.chunks import make_chunks
from tests.services.procs import Pod, start_pod

OLD_CAP = 256  # connections the pod used to serve in all, tokens or not
WAIT_S = 30.0  # generous bound on anything the pod should do "soon"


def half_hello(port: int) -> socket.socket:
    """A socket that starts a hello announcing a long token, then sends nothing more."""
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, wire.MAX_TOKEN))
    return s


def hello(port: int, token: str) -> tuple[socket.socket, wire.Status, str]:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    raw = token.encode()
    s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, len(raw)) + raw)
    status, message, _ = wire.recv_response(s)
    return s, status, message


class Trickler(threading.Thread):
    """Holds `n` sockets without a token on the pod: each sends one more byte of its hello every
    `every_s`, and one the pod closes is opened again at once (an attacker that keeps pressing)."""

    def __init__(self, port: int, n: int, every_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.port, self.every_s = port, every_s
        self.socks = [half_hello(port) for _ in range(n)]
        self.reopened = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.every_s):
            for i, s in enumerate(self.socks):
                try:
                    s.send(b"x")
                except OSError:  # the pod closed it: come back with a new one
                    s.close()
                    self.socks[i] = half_hello(self.port)
                    self.reopened += 1

    def stop(self) -> None:
        self.halt.set()
        self.join(WAIT_S)
        for s in self.socks:
            s.close()


def closed_by_pod(s: socket.socket, within_s: float, trickle: bool = False) -> bool:
    """Whether the pod closes `s` within `within_s` (sending a byte a second meanwhile if `trickle`)."""
    deadline = time.monotonic() + within_s
    s.settimeout(1.0)
    while time.monotonic() < deadline:
        try:
            if trickle:
                s.send(b"x")
            if s.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:  # reset by the pod
            return True
    return False


def gauge(pod: Pod, metric: str) -> float:
    match = re.search(rf"^{metric} (\S+)$", httpx.get(pod.url("/metrics")).text, re.MULTILINE)
    assert match, metric
    return float(match.group(1))


def test_sockets_without_a_token_cannot_lock_the_tenants_out(tmp_path):
    pod = start_pod(tmp_path)
    attack = Trickler(pod.data_port, OLD_CAP + 44)  # more idle, trickling sockets than the pod used to serve
    attack.start()
    try:
        for round_ in range(3):  # a fresh client each round: each needs a new connection while the attack goes on
            client = PodClient(pod.address(), pod.tokens["alpha"], timeout_s=WAIT_S)
            name, obj = make_chunks(1, seed=round_)[0]
            client.put(name, obj)  # before: StoreError, "too many connections"
            assert client.read(name) == obj
            client.close()
            time.sleep(3)  # the attack goes on, past the hello deadline
        assert gauge(pod, "cacheflow_storage_pending_connections") <= 64
    finally:
        attack.stop()
        pod.stop()
    assert attack.reopened > 0  # the pod did close the attacker's sockets


def test_a_hello_trickled_byte_by_byte_is_cut_off(tmp_path):
    pod = start_pod(tmp_path)
    try:
        with half_hello(pod.data_port) as s:
            assert closed_by_pod(s, WAIT_S, trickle=True)  # before: each byte bought another 30 s
    finally:
        pod.stop()


def test_one_tenant_cannot_take_every_connection(tmp_path):
    pod = start_pod(tmp_path)  # tenants alpha and beta: at most half the connections each
    socks: list[socket.socket] = []
    try:
        admitted = 0
        for _ in range(OLD_CAP):
            s, status, message = hello(pod.data_port, pod.tokens["alpha"])
            socks.append(s)
            if status is wire.Status.OK:
                admitted += 1
            else:
                assert status is wire.Status.UNAVAILABLE and "too many connections" in message
        assert admitted == OLD_CAP // 2  # before: all 256, and beta was refused
        beta = pod.client("beta", timeout_s=WAIT_S)
        name, obj = make_chunks(1, seed=9, tenant="beta")[0]
        beta.put(name, obj)
        assert beta.read(name) == obj
    finally:
        for s in socks:
            s.close()
        pod.stop()


def test_idle_connections_are_closed_and_the_client_pool_reconnects(tmp_path):
    pod = start_pod(tmp_path, "--idle-timeout", "1")
    try:
        client = pod.client(timeout_s=WAIT_S)
        name, obj = make_chunks(1, seed=3)[0]
        client.put(name, obj)  # its connection stays in the client's pool, idle
        s, status, _ = hello(pod.data_port, pod.tokens["beta"])
        assert status is wire.Status.OK
        assert closed_by_pod(s, WAIT_S)
        s.close()
        deadline = time.monotonic() + WAIT_S
        while gauge(pod, "cacheflow_storage_connections") > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gauge(pod, "cacheflow_storage_connections") == 0  # the pooled one was closed too
        assert client.read(name) == obj  # the stale pooled connection is retried on a new one
        assert not client.failed_within(3600)  # and that is not counted as a failure of the pod
    finally:
        pod.stop()
