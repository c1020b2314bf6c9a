"""A storage pod's control API authenticates before it reads a body, and bounds the bytes it reads,
chunked bodies included (a real pod process on loopback)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.services.procs import Pod, start_pod

LIMIT = 1 << 20  # the control API's largest body
WAIT_S = 30.0


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    p = start_pod(tmp_path_factory.mktemp("pod"))
    yield p
    p.stop()


def chunked_head(pod: Pod, headers: str = "") -> bytes:
    return (f"POST /v1/chunks/exists HTTP/1.1\r\nHost: 127.0.0.1:{pod.http_port}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n{headers}\r\n").encode()


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def test_a_body_without_a_token_is_refused_before_it_is_read(pod):
    with socket.create_connection(("127.0.0.1", pod.http_port), timeout=WAIT_S) as s:
        s.sendall(chunked_head(pod) + chunk(b"x" * 65536))  # a chunked body that never ends
        reply = s.recv(4096)  # before: no answer until the whole body had been read
    assert reply.startswith(b"HTTP/1.1 401")


def test_a_chunked_body_is_bounded_by_the_bytes_read(pod):
    names = [f"n{i:06d}" + "a" * 57 for i in range(2 * LIMIT // 64)]  # valid names, about 2 MiB of JSON
    body = json.dumps({"names": names}).encode()

    def pieces() -> Iterator[bytes]:  # no Content-Length: httpx sends it chunked
        for start in range(0, len(body), 65536):
            yield body[start : start + 65536]

    r = httpx.post(pod.url("/v1/chunks/exists"), content=pieces(), headers=pod.headers(), timeout=WAIT_S)
    assert r.status_code == 413 and "over" in r.json()["detail"]  # before: read whole, then answered 422
    small = json.dumps({"names": ["abc", "def"]}).encode()  # a chunked body within the limit is served
    with socket.create_connection(("127.0.0.1", pod.http_port), timeout=WAIT_S) as s:
        s.sendall(chunked_head(pod, f"Authorization: Bearer {pod.tokens['alpha']}\r\nConnection: close\r\n")
                  + chunk(small[:5]) + chunk(small[5:]) + b"0\r\n\r\n")
        reply = b"".join(iter(lambda: s.recv(65536), b""))  # to the end: the pod closes after answering
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"exists":[false,false]}')
    unauthorized = httpx.post(pod.url("/v1/chunks/exists"), json={"names": ["abc"]})
    assert unauthorized.status_code == 401 and unauthorized.headers["www-authenticate"] == "Bearer"
    assert httpx.get(pod.url("/healthz")).status_code == 200  # probes need no token
