"""A real storage pod process on loopback: data plane, control API, tenancy, bounds and integrity."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from cacheflow_common.errors import BadRequestError, UnauthorizedError
from cacheflow_common.transport import wire
from cacheflow_common.transport.pod_client import PodAddress, PodClient
from tests.services.chunks import layout, make_chunks
from tests.services.procs import Pod, start_pod


@pytest.fixture(scope="module")
def pod(tmp_path_factory) -> Iterator[Pod]:
    p = start_pod(tmp_path_factory.mktemp("pod"))
    yield p
    p.stop()


def test_put_then_whole_and_ranged_reads_return_the_exact_bytes(pod):
    client = pod.client()
    chunks = make_chunks(3, seed=1)
    for name, obj in chunks:
        client.put(name, obj)
    lay = layout()
    for name, obj in chunks:
        assert client.size(name) == len(obj)
        assert client.read(name) == obj
        section = bytearray(lay.section_size)  # layer 2's section only: one ranged read
        assert client.read_into(name, memoryview(section), lay.section_offset(2))
        assert bytes(section) == obj[lay.section_offset(2) : lay.section_offset(3)]
    assert client.tenant == "alpha"
    name, obj = chunks[0]
    parts = [bytearray(n) for n in (10, 0, len(obj) - 20, 3)]  # straight into the reader's buffers
    assert client.readv_into(name, [memoryview(p) for p in parts], 5)
    assert b"".join(parts) == obj[5:-2]


def test_absent_and_out_of_range_reads_are_misses(pod):
    client = pod.client()
    name, obj = make_chunks(1, seed=2)[0]
    assert not client.read_into(name, memoryview(bytearray(10)))
    client.put(name, obj)
    assert not client.read_into(name, memoryview(bytearray(10)), len(obj) - 5)
    assert client.read(name + "x") is None and not client.exists(name + "x")


def test_delete(pod):
    client = pod.client()
    name, obj = make_chunks(1, seed=3)[0]
    client.put(name, obj)
    client.delete(name)
    assert not client.exists(name)
    client.delete(name)  # absent: not an error


def test_tenants_cannot_reach_each_other(pod):
    alpha, beta = pod.client("alpha"), pod.client("beta")
    name, obj = make_chunks(1, seed=4)[0]
    alpha.put(name, obj)
    assert beta.read(name) is None and not beta.exists(name)  # the same name, another tenant: nothing there
    r = httpx.post(pod.url("/v1/chunks/exists"), json={"names": [name]}, headers=pod.headers("beta"))
    assert r.json() == {"exists": [False]}
    r = httpx.post(pod.url("/v1/chunks/exists"), json={"names": [name]}, headers=pod.headers("alpha"))
    assert r.json() == {"exists": [True]}


def test_wrong_or_missing_token_is_refused(pod):
    bad = PodClient(PodAddress("p", "127.0.0.1", pod.data_port), "not-a-token-of-this-pod")
    with pytest.raises(UnauthorizedError):
        bad.read_into("abc", memoryview(bytearray(4)))
    assert httpx.post(pod.url("/v1/chunks/exists"), json={"names": []}).status_code == 401
    assert httpx.get(pod.url("/v1/stats"), headers={"Authorization": "Bearer nope"}).status_code == 401
    assert httpx.get(pod.url("/healthz")).status_code == 200  # probes need no token


def test_malformed_requests_get_a_reason(pod):
    client = pod.client()
    with pytest.raises(BadRequestError, match="not a valid chunk"):
        client.put("abc.kv.L0-1", b"\x00" * 100)
    name, obj = make_chunks(1, seed=5)[0]
    client.put(name, obj)  # the connection is still usable after a refused put
    with pytest.raises(BadRequestError, match="invalid object name"):
        client.put("../escape", obj)
    headers = pod.headers()
    r = httpx.post(pod.url("/v1/chunks/exists"), json={"names": ["ok"] * 5000}, headers=headers)
    assert r.status_code == 400 and "at most 4096" in r.json()["detail"]
    r = httpx.post(pod.url("/v1/chunks/exists"), json={"names": ["../x"]}, headers=headers)
    assert r.status_code == 400 and "invalid object name" in r.json()["detail"]
    r = httpx.post(pod.url("/v1/chunks/exists"), json={"names": "x"}, headers=headers)
    assert r.status_code == 422
    r = httpx.post(pod.url("/v1/chunks/exists"), content=b"x" * (2 << 20), headers=headers)
    assert r.status_code == 413


def test_garbage_and_oversized_requests_on_the_data_plane(pod):
    with socket.create_connection(("127.0.0.1", pod.data_port), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\n\r\n")
        status, message, _ = wire.recv_response(s)
        assert status is wire.Status.BAD_REQUEST and "hello" in message
    with socket.create_connection(("127.0.0.1", pod.data_port), timeout=5) as s:
        token = pod.tokens["alpha"].encode()
        s.sendall(wire.HELLO.pack(wire.HELLO_MAGIC, len(token)) + token)
        assert wire.recv_response(s)[0] is wire.Status.OK
        s.sendall(wire.pack_request(wire.Op.GET, "abc", length=1 << 40))  # 1 TiB: refused before allocating
        status, message, _ = wire.recv_response(s)
        assert status is wire.Status.BAD_REQUEST and "must be 1.." in message
        s.sendall(wire.pack_request(wire.Op.PUT, "abc", length=1 << 40))
        status, message, _ = wire.recv_response(s)
        assert status is wire.Status.BAD_REQUEST
        assert s.recv(1) == b""  # a refused body cannot be skipped: the pod closes the connection


def test_corrupt_chunk_is_a_counted_miss_and_is_dropped(tmp_path):
    p = start_pod(tmp_path)
    try:
        client = p.client()
        name, obj = make_chunks(1, seed=6)[0]
        client.put(name, obj)
        path = next((tmp_path / "chunks").rglob(f"{name}*"))
        raw = bytearray(path.read_bytes())
        raw[layout().section_offset(1) + 100] ^= 0xFF  # one flipped bit in layer 1's payload
        path.write_bytes(raw)
        assert client.read(name) is None
        assert not path.exists()  # dropped: never served, and the next save stores a good copy
        stats = httpx.get(p.url("/v1/stats"), headers=p.headers()).json()
        assert stats["corrupt"] == 1
        assert 'cacheflow_storage_reads_total{result="corrupt"} 1.0' in httpx.get(p.url("/metrics")).text
    finally:
        p.stop()


def test_stats_and_metrics(pod):
    client = pod.client()
    for name, obj in make_chunks(2, seed=7):
        client.put(name, obj)
        client.read(name)
    stats = httpx.get(pod.url("/v1/stats"), headers=pod.headers()).json()
    assert stats["tenant"] == "alpha" and stats["backend"] == "filesystem" and stats["hits"] >= 2
    text = httpx.get(pod.url("/metrics")).text
    for metric in ("cacheflow_storage_reads_total", "cacheflow_storage_read_bytes_total",
                   "cacheflow_storage_writes_total", "cacheflow_storage_connections"):
        assert metric in text
    assert httpx.get(pod.url("/readyz")).json() == {"ready": True, "reason": ""}
