"""A frame for one tensor and its metadata, in one HTTP body: how stages pass hidden states.

Layout: `b"CFT1"`, a u32 (little-endian) JSON length, the JSON metadata, then the tensor's raw bytes
(C order). The metadata carries `dtype` and `shape` of the tensor (absent when there is none).
Every size is checked against the body before anything is allocated: a bad frame is a
`BadRequestError` with the reason, never a crash or a huge allocation.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import torch

from cacheflow_common.errors import BadRequestError

MAGIC = b"CFT1"
_HEAD = struct.Struct("<4sI")
MAX_META_BYTES = 4 << 20  # token ids of a long prompt fit comfortably
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONTENT_TYPE = "application/x-cacheflow-tensor"


def pack(meta: dict[str, Any], tensor: torch.Tensor | None = None) -> bytes:
    """meta + tensor (any shape, a dtype of `DTYPES`) -> frame bytes."""
    body = dict(meta)
    payload = b""
    if tensor is not None:
        t = tensor.detach().to("cpu").contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in DTYPES:
            raise BadRequestError(f"cannot send a {name} tensor")
        body.update(dtype=name, shape=list(t.shape))
        payload = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    text = json.dumps(body, separators=(",", ":")).encode()
    return _HEAD.pack(MAGIC, len(text)) + text + payload


def unpack(frame: bytes) -> tuple[dict[str, Any], torch.Tensor | None]:
    """frame bytes -> (meta, tensor or None); BadRequestError on any inconsistency."""
    if len(frame) < _HEAD.size:
        raise BadRequestError("tensor frame shorter than its header")
    magic, meta_len = _HEAD.unpack_from(frame)
    if magic != MAGIC:
        raise BadRequestError("not a tensor frame (bad magic)")
    if meta_len > MAX_META_BYTES or _HEAD.size + meta_len > len(frame):
        raise BadRequestError(f"tensor frame metadata of {meta_len} bytes does not fit the body")
    try:
        meta = json.loads(frame[_HEAD.size : _HEAD.size + meta_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestError(f"tensor frame metadata is not JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise BadRequestError("tensor frame metadata must be an object")
    payload = frame[_HEAD.size + meta_len :]
    if "dtype" not in meta:
        if payload:
            raise BadRequestError("tensor frame carries bytes but no dtype/shape")
        return meta, None
    return meta, _tensor(meta, payload)


def _tensor(meta: dict[str, Any], payload: bytes) -> torch.Tensor:
    dtype, shape = DTYPES.get(str(meta.get("dtype"))), meta.get("shape")
    if dtype is None:
        raise BadRequestError(f"tensor dtype {meta.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise BadRequestError(f"tensor shape {shape!r} is not a list of sizes")
    expected = math.prod(shape) * dtype.itemsize
    if expected != len(payload):
        raise BadRequestError(f"tensor of shape {shape} needs {expected} bytes, the frame has {len(payload)}")
    if not payload:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).reshape(shape)
