"""A storage pod allocates only what it actually sends or receives, within one pod-wide budget
(real pod processes on loopback; memory read from /proc/<pid>/status, no assertion on speed)."""

from __future__ import annotations

import re
import socket
import threading
import time

import httpx

from cacheflow_common.transport import wire
from cacheflow_common.transport.wire import Op, Status
from tests.services.chunks import big_chunk, make_chunks
from tests.services.procs import Pod, start_pod

MiB = 1 << 20
HUGE = 256 * MiB  # the pod's default largest object: each request below asks for all of it
GROWTH_BOUND = 128 * MiB
WAIT_S = 30.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib * 1024


def authenticated(pod: Pod, tenant: str = "alpha") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", pod.data_port), timeout=WAIT_S)
    token = pod.tokens[tenant].encode()
    s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, len(token)) + token)
    assert wire.recv_response(s)[0] is Status.OK
    return s


def peak_rss(pid: int, seconds: float) -> int:
    """The largest RSS seen over a few seconds (the pod handles the requests meanwhile)."""
    peak, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        peak = max(peak, rss_bytes(pid))
        time.sleep(0.1)
    return peak


def buffered_bytes(pod: Pod) -> float:
    text = httpx.get(pod.url("/metrics")).text
    match = re.search(r"^cacheflow_storage_buffered_bytes (\S+)$", text, re.MULTILINE)
    assert match
    return float(match.group(1))


def test_absent_reads_and_bodiless_puts_hold_no_memory(tmp_path):
    pod = start_pod(tmp_path)
    held: list[socket.socket] = []
    try:
        assert pod.proc is not None
        client = pod.client(timeout_s=WAIT_S)
        big_name, big = big_chunk(24)
        client.put(big_name, big)  # warm up every path once: a put, a read, an absent read
        assert client.read(big_name) == big
        assert client.read("absent-warm-up") is None
        before = rss_bytes(pod.proc.pid)
        for i in range(4):  # ask for 256 MiB of objects that do not exist
            s = authenticated(pod)
            s.sendall(wire.pack_request(Op.GET, f"absent-{i}", length=HUGE))
            assert wire.recv_response(s)[0] is Status.MISS
            held.append(s)
        for i in range(4):  # announce 256 MiB PUTs, and send no body
            s = authenticated(pod)
            s.sendall(wire.pack_request(Op.PUT, f"never-sent-{i}", length=HUGE))
            held.append(s)
        for _ in range(3):  # read a real 24 MB object and never take the answer
            s = authenticated(pod)
            s.sendall(wire.pack_request(Op.GET, big_name, length=len(big)))
            held.append(s)
        grown = peak_rss(pod.proc.pid, 3.0) - before
        assert grown < GROWTH_BOUND, f"the pod grew by {grown / MiB:.0f} MiB"  # before: over 2 GiB
        beta = pod.client("beta", timeout_s=WAIT_S)  # real work goes on meanwhile
        for name, obj in make_chunks(3, seed=5, tenant="beta"):
            beta.put(name, obj)
            assert beta.read(name) == obj
        assert client.read(big_name) == big
    finally:
        for s in held:
            s.close()
        pod.stop()


def test_buffered_bytes_are_capped_for_the_whole_pod(tmp_path):
    pod = start_pod(tmp_path, "--max-buffered", "5MiB", "--max-object", "5MiB")
    try:
        first_name, first = big_chunk(4, seed=1)  # a little over 4 MiB
        second_name, second = big_chunk(1, seed=2)  # a little over 1 MiB: does not fit beside the first
        slow = authenticated(pod)
        slow.sendall(wire.pack_request(Op.PUT, first_name, length=len(first)) + first[:-1])  # all but one byte
        deadline = time.monotonic() + WAIT_S
        while buffered_bytes(pod) < len(first) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert buffered_bytes(pod) == len(first)
        other = pod.client("beta", timeout_s=WAIT_S)
        errors: list[BaseException] = []

        def put_second() -> None:
            try:
                other.put(second_name, second)
            except BaseException as exc:  # reported by the assertion below
                errors.append(exc)

        waiting = threading.Thread(target=put_second)
        waiting.start()
        waiting.join(1.0)
        assert waiting.is_alive()  # it waits for room rather than growing the pod past its budget
        assert buffered_bytes(pod) <= 5 * MiB
        slow.sendall(first[-1:])
        assert wire.recv_response(slow)[0] is Status.OK
        waiting.join(WAIT_S)
        assert not waiting.is_alive() and not errors
        assert pod.client(timeout_s=WAIT_S).read(first_name) == first
        assert other.read(second_name) == second
        slow.close()
    finally:
        pod.stop()
