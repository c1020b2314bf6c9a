"""The storage data plane's wire format (TCP; NIXL uses it as its control channel).

A connection starts with a hello that carries the bearer token; the pod answers with the tenant the
token belongs to, or refuses and closes. Then any number of requests, each answered in order:

    hello    = b"CFD1" | u16 token length | token (UTF-8)
    request  = b"CFQ1" | u8 op | u8 0 | u16 name length | u64 offset | u64 length | u64 extra | name
               (PUT: then `length` payload bytes; NIXL_GET: `extra` is the address the pod writes to;
                NIXL_HELLO: then `length` bytes of the client agent's NIXL metadata)
    response = u8 status | 3 x 0 | u32 message length | u64 data length | message (UTF-8) | data

A GET answers OK with exactly `length` bytes, or MISS / CORRUPT with none: the client treats both as
a miss. Sizes are bounded (`MAX_NAME`, the pod's object limit) before anything is allocated.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Sequence
from enum import IntEnum

from cacheflow_common.store.base import IOV_MAX, views_after

HELLO_MAGIC = b"CFD1"
REQUEST_MAGIC = b"CFQ1"
HELLO = struct.Struct("<4sH")
REQUEST = struct.Struct("<4sBBHQQQ")
RESPONSE = struct.Struct("<B3xIQ")
MAX_TOKEN = 4096  # bytes of a bearer token
MAX_NAME = 256  # bytes of an object name (names are at most 200 characters)
MAX_MESSAGE = 4096  # bytes of a response's reason


class Op(IntEnum):
    GET = 1  # bytes [offset, offset + length) of an object, streamed back
    PUT = 2  # store `length` bytes under the name (a whole chunk object)
    NIXL_HELLO = 3  # register the client's NIXL agent with the pod (metadata follows)
    NIXL_GET = 4  # like GET, but the pod writes the bytes into the client's registered memory at `extra`
    STAT = 5  # the object's size, as the response's message (MISS when absent)
    DELETE = 6  # remove the object (absent is not an error)


class Status(IntEnum):
    OK = 0
    MISS = 1  # absent (or the range is outside the object)
    CORRUPT = 2  # present but failed its checksum: counted and dropped by the pod
    BAD_REQUEST = 3  # malformed or out of bounds; the message says why
    UNAUTHORIZED = 4  # no or a wrong bearer token
    UNAVAILABLE = 5  # the pod could not serve it now (backend down, over its connection limit)


class WireError(Exception):
    """The peer broke the protocol or the connection closed mid-message (internal: becomes a miss or a 4xx)."""


def recv_exact_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill all of `view` from the socket (WireError if the peer closes first).

    `deadline` (monotonic seconds): all of it must have arrived by then (TimeoutError), however the
    peer paces its bytes; without it, only the socket's own timeout bounds each wait.
    """
    done, timeout = 0, sock.gettimeout()
    try:
        while done < len(view):
            if deadline is not None:
                sock.settimeout(_time_left(deadline))
            n = sock.recv_into(view[done:])
            if n == 0:
                raise WireError("connection closed mid-message")
            done += n
    finally:
        if deadline is not None:
            sock.settimeout(timeout)


def recv_exact_into_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """`recv_exact_into`, scattered over `views` (filled one after another, a batch of them per call; one
    at a time over TLS, which has no scatter read)."""
    if isinstance(sock, ssl.SSLSocket):
        for view in views:
            recv_exact_into(sock, view)
        return
    left = list(views)
    while left:
        n = sock.recvmsg_into(left[:IOV_MAX])[0]
        if n == 0:
            raise WireError("connection closed mid-message")
        left = views_after(left, n)


def _time_left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the peer did not send its message in time")
    return left


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def send_response(sock: socket.socket, status: Status, message: str = "", data_len: int = 0) -> None:
    """The response header and reason; the caller streams `data_len` bytes after it."""
    msg = message.encode()[:MAX_MESSAGE]
    sock.sendall(RESPONSE.pack(status, len(msg), data_len) + msg)


def recv_response(sock: socket.socket) -> tuple[Status, str, int]:
    """(status, message, data length); the caller then reads the data."""
    status, msg_len, data_len = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
    if msg_len > MAX_MESSAGE:
        raise WireError(f"response message of {msg_len} bytes")
    try:
        return Status(status), recv_exact(sock, msg_len).decode(errors="replace"), data_len
    except ValueError as exc:
        raise WireError(f"unknown status {status}") from exc


def pack_request(op: Op, name: str, *, offset: int = 0, length: int = 0, extra: int = 0) -> bytes:
    raw = name.encode()
    return REQUEST.pack(REQUEST_MAGIC, op, 0, len(raw), offset, length, extra) + raw
