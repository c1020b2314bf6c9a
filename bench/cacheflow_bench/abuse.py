"""What a hostile but fair client does to a cluster, for `cacheflow bench chaos`: bounded, on loopback.

* `idle_sockets`: many connections to a pod's data port that never finish their hello, each trickling
  one byte now and then (the lockout: a pod that lets them take every slot refuses everyone).
* `hoard_memory`: authenticated connections asking for huge reads of absent chunks, and PUT headers
  announcing huge bodies that never come (a pod that reserves memory before it has the bytes grows).
* `wasted_slots`: coordinator requests that must not keep a batch slot: an unknown policy, and
  streams whose client goes away before the first token.
* `LegitProbe`: meanwhile a legitimate tenant asks the pod for a chunk's size every `period_s`; the
  time its answers were refusals is the lockout.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from cacheflow_common.transport import wire
from cacheflow_common.transport.wire import Op, Status

HUGE = 256 << 20  # bytes a hoarding request asks for or announces


@contextlib.contextmanager
def idle_sockets(port: int, count: int, *, trickle_s: float = 2.0) -> Iterator[None]:
    """`count` connections to `port` that send one byte of a hello every `trickle_s`, until the block ends."""
    socks: list[socket.socket] = []
    for _ in range(count):
        with contextlib.suppress(OSError):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))

    def trickle() -> None:
        for sock in socks:
            with contextlib.suppress(OSError):  # the pod closed it: the others go on
                sock.send(wire.HELLO_MAGIC[:1])

    try:
        with every(trickle_s, trickle):
            yield
    finally:
        for sock in socks:
            sock.close()


@contextlib.contextmanager
def every(period_s: float, action: Callable[[], None]) -> Iterator[None]:
    """Run `action` every `period_s` on a thread of its own until the block ends (an OSError skips a round)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(period_s):
            with contextlib.suppress(OSError):
                action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


@contextlib.contextmanager
def hoard_memory(port: int, token: str, count: int) -> Iterator[None]:
    """`count` authenticated connections each asking for a huge absent read, and `count` announcing a huge
    PUT whose body never comes; held open until the block ends."""
    socks: list[socket.socket] = []
    for i in range(count):
        for op in (Op.GET, Op.PUT):
            with contextlib.suppress(OSError, wire.WireError):
                sock = _authenticated(port, token)
                socks.append(sock)
                sock.sendall(wire.pack_request(op, f"absent-{i}.kv.L0-1", length=HUGE))
    try:
        yield
    finally:
        for sock in socks:
            sock.close()


def _authenticated(port: int, token: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    raw = token.encode()
    sock.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, len(raw)) + raw)
    status, message, _ = wire.recv_response(sock)
    if status is not Status.OK:
        sock.close()
        raise wire.WireError(f"hello refused: {status.name} {message}")
    return sock


def wasted_slots(url: str, token: str, model: str, count: int) -> int:
    """`count` requests with an unknown policy, then `count` streams dropped before their first token; how
    many of the bad ones were not refused with a 4xx (0 when the coordinator behaves)."""
    headers = {"Authorization": f"Bearer {token}"}
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 4}
    not_refused = 0
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        for _ in range(count):
            answer = client.post("/v1/completions", json=body | {"policy": "no-such-policy"})
            not_refused += not 400 <= answer.status_code < 500
        for _ in range(count):
            with client.stream("POST", "/v1/completions", json=body | {"stream": True, "max_tokens": 64}):
                pass  # the client goes away before reading a byte
    return not_refused


class LegitProbe:
    """A tenant asking a pod for one name's size every `period_s`; `lockout_s` sums the periods refused."""

    def __init__(self, port: int, token: str, *, period_s: float = 0.2) -> None:
        self.port, self.token, self.period_s = port, token, period_s
        self.lockout_s = 0.0
        self.probes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="legit-probe", daemon=True)

    def __enter__(self) -> LegitProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.monotonic()
            if not self._served():
                self.lockout_s += max(self.period_s, time.monotonic() - began)
            self.probes += 1
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - began)))

    def _served(self) -> bool:
        """One fresh connection (a new client meets the connection limits): hello accepted, a STAT answered."""
        try:
            sock = _authenticated(self.port, self.token)
        except (OSError, wire.WireError):
            return False
        with sock:
            try:
                sock.sendall(wire.pack_request(Op.STAT, "legit-probe.kv.L0-1"))
                status, _, _ = wire.recv_response(sock)
            except (OSError, wire.WireError):
                return False
        return status in (Status.OK, Status.MISS)


def rss_mb(pid: int) -> float:
    """A process's resident memory (VmRSS), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
