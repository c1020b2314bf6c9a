"""The chunk object: one stored value per chunk, header and payload together.

    object  = section[0] | ... | section[n-1] | trailer JSON | u32 trailer length | b"CFKVEND1"
    section = 64-byte header (b"CFS1", u32 layer, u32 token_start, u32 token_end, u32 crc32(payload),
              u64 payload length, 16-byte chunk key digest, zero padding) | payload
    payload = K then V of one layer, [2, Hkv, T, D] in the dtype ("none"), or int8 values [2, Hkv, T, D]
              then float32 scales [2, Hkv, T] ("int8"); kind "hidden": [T, hidden] (a stage boundary activation)

Every section of a chunk has the same size, computable without reading anything, so token-wise
restore reads the whole object and layer-wise restore reads one layer's section of each object —
no byte is read twice. Each section verifies itself (key, layer, token range, checksum), so a ranged
read is as safe as a whole one. Landing uses numpy only: it runs in the loader thread next to the
forward pass and must not compete for torch's thread pool.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cacheflow_common.errors import ChunkFormatError
from cacheflow_common.kv.keys import ChunkKey
from cacheflow_common.kv.quant import quantize_int8

SECTION_MAGIC = b"CFS1"
END_MAGIC = b"CFKVEND1"
SECTION_HEADER = struct.Struct("<4sIIIIQ16s")  # magic, layer, token_start, token_end, crc32, payload_len, key
SECTION_HEADER_SIZE = 64  # padded: payloads stay 64-byte aligned inside the object
FORMAT_VERSION = 1
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class ChunkLayout:
    """Sizes and offsets of one chunk object, known before reading it."""

    kind: str  # "kv" | "hidden"
    layer_start: int
    layer_end: int
    n_tokens: int
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = "bfloat16"
    quant: str = "none"  # "none" | "int8"
    hidden_size: int = 0

    @property
    def payload_size(self) -> int:
        if self.kind == "hidden":
            return self.n_tokens * self.hidden_size * ITEMSIZE[self.dtype]
        values = 2 * self.num_kv_heads * self.n_tokens * self.head_dim
        if self.quant == "int8":
            return values + 2 * self.num_kv_heads * self.n_tokens * 4
        return values * ITEMSIZE[self.dtype]

    @property
    def section_size(self) -> int:
        return SECTION_HEADER_SIZE + self.payload_size

    @property
    def sections_size(self) -> int:
        return (self.layer_end - self.layer_start) * self.section_size

    def section_offset(self, layer: int) -> int:
        """Byte offset of absolute layer `layer`'s section."""
        return (layer - self.layer_start) * self.section_size


@dataclass(frozen=True)
class SectionCheck:
    ok: bool
    reason: str = ""  # "" | "magic" | "layer" | "tokens" | "key" | "crc" | "truncated"


OK = SectionCheck(True)


def _section(layer: int, key: ChunkKey, payload: bytes) -> bytes:
    header = SECTION_HEADER.pack(SECTION_MAGIC, layer, key.token_start, key.token_end, zlib.crc32(payload),
                                 len(payload), key.digest)
    return header.ljust(SECTION_HEADER_SIZE, b"\0") + payload


def _trailer(body: dict[str, Any]) -> bytes:
    raw = json.dumps(body, separators=(",", ":")).encode()
    return raw + struct.pack("<I", len(raw)) + END_MAGIC


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _kv_payload(layer_kv: torch.Tensor, quant: str) -> bytes:
    if quant == "none":
        return _raw_bytes(layer_kv)
    if quant != "int8":
        raise ChunkFormatError(f"unknown quantization {quant!r}")
    q, scales = quantize_int8(layer_kv)  # [2, Hkv, T, D] int8, [2, Hkv, T] float32
    return _raw_bytes(q) + _raw_bytes(scales)


def encode_kv_chunk(*, key: ChunkKey, token_ids: Sequence[int], model: str, layer_start: int,
                    kv: torch.Tensor, dtype: str, quant: str = "none") -> bytes:
    """kv: [n_layers, 2, Hkv, T, D] of `dtype` -> the chunk object's bytes."""
    n_layers, _, heads, n_tokens, head_dim = kv.shape
    if n_tokens != key.n_tokens or len(token_ids) != n_tokens:
        raise ChunkFormatError(f"chunk holds {n_tokens} tokens but its key covers {key.n_tokens}")
    if kv.dtype != TORCH_DTYPES[dtype]:
        raise ChunkFormatError(f"KV dtype {kv.dtype} does not match {dtype}")
    sections = [_section(layer_start + i, key, _kv_payload(kv[i], quant)) for i in range(n_layers)]
    trailer = {"format": FORMAT_VERSION, "kind": "kv", "model": model, "key": key.hex,
               "layer_start": layer_start, "layer_end": layer_start + n_layers,
               "token_start": key.token_start, "token_end": key.token_end, "token_ids": list(token_ids),
               "dtype": dtype, "num_kv_heads": heads, "head_dim": head_dim, "quant": quant}
    return b"".join(sections) + _trailer(trailer)


def encode_hidden_chunk(*, key: ChunkKey, token_ids: Sequence[int], model: str, layer: int,
                        hidden: torch.Tensor, dtype: str) -> bytes:
    """hidden: [T, hidden_size], the state entering `layer` -> the chunk object's bytes."""
    n_tokens, hidden_size = hidden.shape
    if n_tokens != key.n_tokens or hidden.dtype != TORCH_DTYPES[dtype]:
        raise ChunkFormatError("hidden chunk does not match its key or dtype")
    trailer = {"format": FORMAT_VERSION, "kind": "hidden", "model": model, "key": key.hex,
               "layer_start": layer, "layer_end": layer + 1, "token_start": key.token_start,
               "token_end": key.token_end, "token_ids": list(token_ids), "dtype": dtype,
               "hidden_size": hidden_size, "quant": "none"}
    return _section(layer, key, _raw_bytes(hidden)) + _trailer(trailer)


def read_trailer(obj: bytes | memoryview) -> dict[str, Any]:
    mv = memoryview(obj)
    if len(mv) < 12 or bytes(mv[-8:]) != END_MAGIC:
        raise ChunkFormatError("not a chunk object (bad end magic or truncated)")
    (length,) = struct.unpack("<I", mv[-12:-8])
    if length > len(mv) - 12:
        raise ChunkFormatError("chunk trailer length exceeds the object")
    try:
        body: dict[str, Any] = json.loads(bytes(mv[-12 - length : -12]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChunkFormatError(f"chunk trailer is not JSON: {exc}") from exc
    if body.get("format") != FORMAT_VERSION:
        raise ChunkFormatError(f"unsupported chunk format {body.get('format')!r}")
    return body


def verify_section(buf: memoryview, *, layout: ChunkLayout, layer: int, key: ChunkKey) -> SectionCheck:
    """Check one section (exactly `layout.section_size` bytes) against what the reader expects."""
    if len(buf) != layout.section_size:
        return SectionCheck(False, "truncated")
    magic, s_layer, t0, t1, crc, length, digest = SECTION_HEADER.unpack_from(buf, 0)
    if magic != SECTION_MAGIC:
        return SectionCheck(False, "magic")
    if digest != key.digest:
        return SectionCheck(False, "key")
    if s_layer != layer:
        return SectionCheck(False, "layer")
    if (t0, t1) != (key.token_start, key.token_end) or length != layout.payload_size:
        return SectionCheck(False, "tokens")
    if zlib.crc32(buf[SECTION_HEADER_SIZE:]) != crc:
        return SectionCheck(False, "crc")
    return OK


def _payload_bytes(payload: memoryview, layout: ChunkLayout) -> np.ndarray:
    """A section payload as the target dtype's bytes: uint8 [2, Hkv, T, D * itemsize] (numpy only)."""
    h, t, d = layout.num_kv_heads, layout.n_tokens, layout.head_dim
    if layout.quant == "none":
        return np.frombuffer(payload, dtype=np.uint8).reshape(2, h, t, d * ITEMSIZE[layout.dtype])
    q = np.frombuffer(payload, dtype=np.int8, count=2 * h * t * d).reshape(2, h, t, d)
    scales = np.frombuffer(payload, dtype="<f4", offset=2 * h * t * d).reshape(2, h, t, 1)
    x = q.astype(np.float32) * scales  # [2, Hkv, T, D]
    if layout.dtype == "float32":
        return x.view(np.uint8)
    if layout.dtype == "float16":
        return x.astype(np.float16).view(np.uint8)
    return float32_to_bfloat16_bytes(x)


def float32_to_bfloat16_bytes(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16, as bytes [..., D * 2] (what torch's .to(bfloat16) does)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    return rounded.view(np.uint8)


def land_kv_sections(buf: memoryview, *, layout: ChunkLayout, key: ChunkKey, layers: range, dst: np.ndarray,
                     dst_layer_start: int, token_start: int) -> SectionCheck:
    """Verify every section of `layers` in `buf`, then copy them into `dst` (nothing is written on failure).

    buf: the contiguous sections of `layers` as read from `layout.section_offset(layers.start)`.
    dst: uint8 view of a KV buffer, [n_buf_layers, 2, Hkv, capacity, D * itemsize].
    """
    size = layout.section_size
    if len(buf) != size * len(layers):
        return SectionCheck(False, "truncated")
    for i, layer in enumerate(layers):
        check = verify_section(buf[i * size : (i + 1) * size], layout=layout, layer=layer, key=key)
        if not check.ok:
            return check
    t1 = token_start + layout.n_tokens
    for i, layer in enumerate(layers):
        payload = buf[i * size + SECTION_HEADER_SIZE : (i + 1) * size]
        dst[layer - dst_layer_start, :, :, token_start:t1, :] = _payload_bytes(payload, layout)
    return OK


def _layout_of(trailer: dict[str, Any]) -> ChunkLayout:
    return ChunkLayout(kind=trailer["kind"], layer_start=trailer["layer_start"], layer_end=trailer["layer_end"],
                       n_tokens=trailer["token_end"] - trailer["token_start"],
                       num_kv_heads=trailer.get("num_kv_heads", 0), head_dim=trailer.get("head_dim", 0),
                       dtype=trailer["dtype"], quant=trailer.get("quant", "none"),
                       hidden_size=trailer.get("hidden_size", 0))


def _key_of(trailer: dict[str, Any]) -> ChunkKey:
    return ChunkKey(digest=bytes.fromhex(trailer["key"]), index=0, token_start=trailer["token_start"],
                    token_end=trailer["token_end"])


def decode_kv_chunk(obj: bytes | memoryview) -> tuple[dict[str, Any], torch.Tensor]:
    """A whole kv object -> (trailer, [n_layers, 2, Hkv, T, D] tensor); ChunkFormatError on any failure."""
    trailer = read_trailer(obj)
    layout = _layout_of(trailer)
    n_layers = layout.layer_end - layout.layer_start
    itemsize = ITEMSIZE[layout.dtype]
    out = np.zeros((n_layers, 2, layout.num_kv_heads, layout.n_tokens, layout.head_dim * itemsize), np.uint8)
    check = land_kv_sections(memoryview(obj)[: layout.sections_size], layout=layout, key=_key_of(trailer),
                             layers=range(layout.layer_start, layout.layer_end), dst=out,
                             dst_layer_start=layout.layer_start, token_start=0)
    if not check.ok:
        raise ChunkFormatError(f"chunk section invalid: {check.reason}")
    return trailer, torch.from_numpy(out).view(TORCH_DTYPES[layout.dtype])


def decode_hidden_chunk(obj: bytes | memoryview) -> tuple[dict[str, Any], torch.Tensor]:
    """A whole hidden object -> (trailer, [T, hidden_size] tensor); ChunkFormatError on any failure."""
    trailer = read_trailer(obj)
    layout = _layout_of(trailer)
    section = memoryview(obj)[: layout.section_size]
    check = verify_section(section, layout=layout, layer=layout.layer_start, key=_key_of(trailer))
    if not check.ok:
        raise ChunkFormatError(f"hidden chunk invalid: {check.reason}")
    raw = np.frombuffer(section[SECTION_HEADER_SIZE:], dtype=np.uint8).copy()
    hidden = torch.from_numpy(raw).view(TORCH_DTYPES[layout.dtype])
    return trailer, hidden.reshape(layout.n_tokens, layout.hidden_size)
