"""Tensor frames: what stages send each other. Round trips, and a clear error for every bad frame."""

from __future__ import annotations

import struct

import pytest
import torch

from cacheflow_common.errors import BadRequestError
from cacheflow_common.transport import frames


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact(dtype):
    t = torch.randn(5, 7).to(dtype)
    meta, back = frames.unpack(frames.pack({"request_id": "r", "token_ids": [1, 2]}, t))
    assert meta["request_id"] == "r" and meta["token_ids"] == [1, 2] and meta["shape"] == [5, 7]
    assert back is not None and back.dtype == dtype and torch.equal(back, t)


def test_frames_without_a_tensor_and_with_an_empty_one():
    assert frames.unpack(frames.pack({"a": 1})) == ({"a": 1}, None)
    _, empty = frames.unpack(frames.pack({}, torch.zeros(0, 3)))
    assert empty is not None and empty.shape == (0, 3)


def _frame(meta: bytes, payload: bytes = b"", magic: bytes = b"CFT1", length: int | None = None) -> bytes:
    return struct.pack("<4sI", magic, len(meta) if length is None else length) + meta + payload


@pytest.mark.parametrize("frame,reason", [
    (b"CF", "shorter than its header"),
    (_frame(b"{}", magic=b"XXXX"), "bad magic"),
    (_frame(b"{}", length=1 << 30), "does not fit"),
    (_frame(b"{not json"), "not JSON"),
    (_frame(b"[1]"), "must be an object"),
    (_frame(b"{}", b"\x00" * 4), "no dtype/shape"),
    (_frame(b'{"dtype":"int64","shape":[1]}', b"\x00" * 8), "is not one of"),
    (_frame(b'{"dtype":"float32","shape":[-1]}', b""), "not a list of sizes"),
    (_frame(b'{"dtype":"float32","shape":[2,2]}', b"\x00" * 12), "needs 16 bytes"),
])
def test_bad_frames_are_refused_with_the_reason(frame, reason):
    with pytest.raises(BadRequestError, match=reason):
        frames.unpack(frame)


def test_only_float_tensors_are_sent():
    with pytest.raises(BadRequestError, match="cannot send"):
        frames.pack({}, torch.zeros(2, dtype=torch.int64))
