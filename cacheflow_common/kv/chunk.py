"""The chunk object: one stored value per chunk, header and payload together.

    object  = section[0] | ... | section[n-1] | trailer JSON | u32 trailer length | b"CFKVEND1"
    section = 64-byte header (b"CFS1", u32 layer, u32 token_start, u32 token_end, u32 crc32(payload),
              u64 payload length, 16-byte chunk key digest, u32 head_start, u32 head_end, u32 total heads,
              zero padding) | payload
    payload = K then V of one layer, [2, Hkv, T, D] in the dtype ("none"), or int8 values [2, Hkv, T, D]
              then float32 scales [2, Hkv, T] ("int8"); kind "hidden": [T, hidden] (a stage boundary activation)

Every section of a chunk has the same size, computable without reading anything (`ChunkLayout`), so
token-wise restore reads the whole object and layer-wise restore reads one layer's section of each
object with one ranged read: no byte is read twice. Each section verifies itself (key digest, layer,
token range, KV heads, crc32), so a ranged read is as safe as a whole one.

A chunk holds all of a model's KV heads (head fields 0, 0, 0), or a tensor-parallel rank's run of them
[head_start, head_end) of the total (`HeadRange`): a reader holding other heads takes its own out of the
objects that hold them (`land_kv_sections`' `take`).

Landing (`land_kv_sections`) uses numpy and `checksum.crc32` only, both of which release the GIL on
large buffers: it runs in the loader thread next to the forward pass and must not compete for torch's
thread pool.
Encoding may use torch: it runs on the save path.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cacheflow_common.errors import BadRequestError, ChunkFormatError
from cacheflow_common.host_memory import host_buffer
from cacheflow_common.kv.checksum import crc32
from cacheflow_common.kv.keys import ChunkKey, HeadRange
from cacheflow_common.kv.quant import (
    dequantize_int8_np,
    float32_to_bfloat16_bits,
    float32_to_dtype_bytes,
    quantize_int8,
)

SECTION_MAGIC = b"CFS1"
END_MAGIC = b"CFKVEND1"
SECTION_HEADER = struct.Struct("<4sIIIIQ16s")  # magic, layer, token_start, token_end, crc32, payload_len, key
SECTION_HEADER_SIZE = 64  # padded past the packed bytes: room for later fields without moving payloads
HEAD_FIELDS = struct.Struct("<III")  # after SECTION_HEADER: head_start, head_end, total heads (0, 0, 0: all heads)
TRAILER_TAIL = struct.Struct("<I8s")  # trailer length, END_MAGIC
FORMAT_VERSION = 1
# fp8 KV is kept as vLLM's fp8 caches hold it: one byte per value, a uint8 tensor (the scales are the model's)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8}
KINDS = ("kv", "hidden")
QUANTS = ("none", "int8")
_MAX_TRAILER = 64 * 1024 * 1024  # far above any real trailer (token ids of one chunk); bounds a corrupt length


@dataclass(frozen=True, kw_only=True)
class ChunkLayout:
    """Sizes and offsets of one chunk object, known before reading it. Layers are absolute indices."""

    kind: str  # "kv" | "hidden"
    layer_start: int
    layer_end: int  # exclusive; a hidden chunk has one section: layer_end == layer_start + 1
    n_tokens: int
    num_kv_heads: int = 0  # 0: a hidden chunk has no KV heads
    head_dim: int = 0  # 0: a hidden chunk has no KV heads
    dtype: str  # "bfloat16" | "float16" | "float32"
    quant: str = "none"  # "none" | "int8" (kv only): "none" keeps loaded KV bit-exact
    hidden_size: int = 0  # hidden chunks only; 0 for kv
    heads: HeadRange | None = None  # the model's KV heads the chunk holds (kv only); None: all of them

    def __post_init__(self) -> None:
        problem = _layout_problem(self)
        if problem:
            raise ChunkFormatError(f"invalid chunk layout: {problem}")

    @property
    def n_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def payload_size(self) -> int:
        if self.kind == "hidden":
            return self.n_tokens * self.hidden_size * ITEMSIZE[self.dtype]
        values = 2 * self.num_kv_heads * self.n_tokens * self.head_dim
        if self.quant == "int8":
            return values + 2 * self.num_kv_heads * self.n_tokens * 4  # int8 values, then float32 scales
        return values * ITEMSIZE[self.dtype]

    @property
    def head_fields(self) -> tuple[int, int, int]:
        """What each section header says of the chunk's KV heads: (0, 0, 0) for all the model's."""
        h = self.heads
        return (0, 0, 0) if h is None or h.whole else (h.start, h.stop, h.total)

    @property
    def section_size(self) -> int:
        return SECTION_HEADER_SIZE + self.payload_size

    @property
    def sections_size(self) -> int:
        """All sections, without the trailer: the bytes a whole-chunk read needs."""
        return self.n_layers * self.section_size

    def stored_whole(self, size: int | None) -> bool:
        """Whether an object of `size` bytes (None: absent) is long enough for every section and a trailer's end
        (not truncated)."""
        return size is not None and size >= self.sections_size + TRAILER_TAIL.size

    def section_offset(self, layer: int) -> int:
        """Byte offset of absolute layer `layer`'s section within the object."""
        if not self.layer_start <= layer < self.layer_end:
            raise BadRequestError(f"layer {layer} is outside the chunk's [{self.layer_start}, {self.layer_end})")
        return (layer - self.layer_start) * self.section_size


def _layout_problem(lay: ChunkLayout) -> str:
    if lay.kind not in KINDS or lay.dtype not in ITEMSIZE or lay.quant not in QUANTS:
        return f"kind {lay.kind!r}, dtype {lay.dtype!r}, quant {lay.quant!r}"
    if not 0 <= lay.layer_start < lay.layer_end or lay.n_tokens <= 0:
        return f"layers [{lay.layer_start}, {lay.layer_end}), {lay.n_tokens} tokens"
    if lay.kind == "kv" and (lay.num_kv_heads <= 0 or lay.head_dim <= 0):
        return f"kv chunk with {lay.num_kv_heads} heads of {lay.head_dim}"
    if lay.heads is not None and (lay.kind != "kv" or lay.heads.count != lay.num_kv_heads):
        return f"a {lay.kind} chunk of {lay.num_kv_heads} KV heads said to hold heads {lay.heads}"
    if lay.kind == "hidden" and (lay.hidden_size <= 0 or lay.n_layers != 1 or lay.quant != "none"):
        return f"hidden chunk of size {lay.hidden_size}, {lay.n_layers} layers, quant {lay.quant!r}"
    return ""


@dataclass(frozen=True)
class SectionCheck:
    ok: bool
    # "" | "magic" | "key" | "layer" | "tokens" (token range or payload size not as expected) | "heads" | "crc"
    # | "truncated"
    reason: str = ""


OK = SectionCheck(True)


# ---------------------------------------------------------------------------------------------- encoding


def _as_tensor(x: np.ndarray | torch.Tensor, dtype: str) -> torch.Tensor:
    """A torch tensor of `dtype`, or a uint8 numpy view of one ([..., D * itemsize]) -> torch tensor [..., D]."""
    if dtype not in TORCH_DTYPES:
        raise BadRequestError(f"unsupported dtype {dtype!r}: use one of {sorted(TORCH_DTYPES)}")
    if isinstance(x, np.ndarray):
        if x.dtype != np.uint8 or x.ndim == 0 or x.shape[-1] % ITEMSIZE[dtype]:
            raise BadRequestError(f"a numpy KV array must be a uint8 view of {dtype}, got {x.dtype} {x.shape}")
        x = torch.from_numpy(np.ascontiguousarray(x)).view(TORCH_DTYPES[dtype])  # [..., D]
    if x.dtype != TORCH_DTYPES[dtype]:
        raise BadRequestError(f"tensor dtype {x.dtype} does not match {dtype}")
    return x


def _check_span(key: ChunkKey, token_ids: Sequence[int], n_tokens: int, layer_start: int) -> None:
    if layer_start < 0:
        raise BadRequestError(f"layer_start must be >= 0, got {layer_start}")
    if not n_tokens or n_tokens != key.n_tokens or len(token_ids) != n_tokens:
        raise BadRequestError(f"chunk holds {n_tokens} tokens, {len(token_ids)} token ids, key covers {key.n_tokens}")


def _byte_rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., D] as bytes [..., D * itemsize], a view where its last dimension is contiguous (no copy)."""
    t = t.detach()
    if t.ndim == 0 or t.stride(-1) != 1:
        t = t.contiguous()
    return t.view(torch.uint8)


def _trailer_bytes(body: dict[str, Any]) -> bytes:
    raw = json.dumps(body, separators=(",", ":")).encode()
    return raw + TRAILER_TAIL.pack(len(raw), END_MAGIC)


def _assemble(layout: ChunkLayout, key: ChunkKey, payloads: Sequence[Sequence[torch.Tensor]], trailer: bytes
              ) -> memoryview:
    """Sections (header + payload parts copied in place) followed by the trailer, in one read-only buffer (a
    mapping of its own when large: `host_buffer`)."""
    size = layout.section_size
    out = host_buffer(layout.sections_size + len(trailer))
    out[layout.sections_size :] = trailer
    flat = torch.frombuffer(out, dtype=torch.uint8)  # [object bytes]
    for i, parts in enumerate(payloads):
        pos = i * size + SECTION_HEADER_SIZE
        for part in parts:
            rows = _byte_rows(part)  # [..., D * itemsize]
            flat[pos : pos + rows.numel()].view(rows.shape).copy_(rows)
            pos += rows.numel()
        payload = out[i * size + SECTION_HEADER_SIZE : (i + 1) * size]
        SECTION_HEADER.pack_into(out, i * size, SECTION_MAGIC, layout.layer_start + i, key.token_start,
                                 key.token_end, crc32(payload), layout.payload_size, key.digest)
        HEAD_FIELDS.pack_into(out, i * size + SECTION_HEADER.size, *layout.head_fields)
    return out.toreadonly()


def encode_kv_chunk(*, key: ChunkKey, token_ids: Sequence[int], model: str, layer_start: int,
                    kv: np.ndarray | torch.Tensor, dtype: str, quant: str = "none", heads: HeadRange | None = None
                    ) -> memoryview:
    """kv [n_layers, 2, Hkv, T, D] of `dtype` (or its uint8 numpy view) -> the chunk object's bytes; `heads`:
    the model's KV heads kv holds (None: all of them).

    BadRequestError when the arguments do not describe one chunk.
    """
    t = _as_tensor(kv, dtype)  # [L, 2, Hkv, T, D]
    if t.ndim != 5 or t.shape[0] == 0 or t.shape[1] != 2:
        raise BadRequestError(f"KV must be [n_layers, 2, Hkv, T, D], got {tuple(t.shape)}")
    n_layers, _, n_heads, n_tokens, head_dim = t.shape
    _check_span(key, token_ids, n_tokens, layer_start)
    if quant not in QUANTS:
        raise BadRequestError(f"unknown quantization {quant!r}: use one of {QUANTS}")
    layout = ChunkLayout(kind="kv", layer_start=layer_start, layer_end=layer_start + n_layers, n_tokens=n_tokens,
                         num_kv_heads=n_heads, head_dim=head_dim, dtype=dtype, quant=quant, heads=heads)
    payloads: list[list[torch.Tensor]]
    if quant == "int8":
        q, scales = quantize_int8(t)  # [L, 2, Hkv, T, D] int8, [L, 2, Hkv, T] float32
        payloads = [[q[i], scales[i]] for i in range(n_layers)]
    else:
        payloads = [[t[i]] for i in range(n_layers)]
    trailer = {"format": FORMAT_VERSION, "kind": "kv", "model": model, "key": key.hex,
               "layer_start": layer_start, "layer_end": layer_start + n_layers,
               "token_start": key.token_start, "token_end": key.token_end, "token_ids": [int(i) for i in token_ids],
               "dtype": dtype, "num_kv_heads": n_heads, "head_dim": head_dim, "quant": quant}
    if layout.head_fields != (0, 0, 0):
        trailer["heads"] = list(layout.head_fields)
    return _assemble(layout, key, payloads, _trailer_bytes(trailer))


def encode_hidden_chunk(*, key: ChunkKey, token_ids: Sequence[int], model: str, layer: int,
                        hidden: torch.Tensor, dtype: str) -> memoryview:
    """hidden [T, hidden_size]: the state entering absolute layer `layer` -> the chunk object's bytes."""
    h = _as_tensor(hidden, dtype)  # [T, hidden]
    if h.ndim != 2:
        raise BadRequestError(f"hidden must be [T, hidden_size], got {tuple(h.shape)}")
    n_tokens, hidden_size = h.shape
    _check_span(key, token_ids, n_tokens, layer)
    layout = ChunkLayout(kind="hidden", layer_start=layer, layer_end=layer + 1, n_tokens=n_tokens, dtype=dtype,
                         hidden_size=hidden_size)
    trailer = {"format": FORMAT_VERSION, "kind": "hidden", "model": model, "key": key.hex,
               "layer_start": layer, "layer_end": layer + 1, "token_start": key.token_start,
               "token_end": key.token_end, "token_ids": [int(i) for i in token_ids], "dtype": dtype,
               "hidden_size": hidden_size, "quant": "none"}
    return _assemble(layout, key, [[h]], _trailer_bytes(trailer))


# ---------------------------------------------------------------------------------------------- reading


def _trailer_span(mv: memoryview) -> int:
    """The trailer JSON's length; ChunkFormatError if the object's end is malformed."""
    if len(mv) < TRAILER_TAIL.size:
        raise ChunkFormatError("not a chunk object: shorter than its end marker")
    length, magic = TRAILER_TAIL.unpack_from(mv, len(mv) - TRAILER_TAIL.size)
    if magic != END_MAGIC:
        raise ChunkFormatError("not a chunk object (bad end magic, or truncated)")
    if length > min(len(mv) - TRAILER_TAIL.size, _MAX_TRAILER):
        raise ChunkFormatError("chunk trailer length exceeds the object")
    return int(length)


def read_trailer(obj: bytes | memoryview) -> dict[str, Any]:
    """The trailer JSON of a whole object; ChunkFormatError if malformed."""
    mv = memoryview(obj).cast("B")
    length = _trailer_span(mv)
    end = len(mv) - TRAILER_TAIL.size
    try:
        body = json.loads(bytes(mv[end - length : end]))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChunkFormatError(f"chunk trailer is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ChunkFormatError("chunk trailer is not a JSON object")
    if body.get("format") != FORMAT_VERSION:
        raise ChunkFormatError(f"unsupported chunk format {body.get('format')!r}")
    return body


def layout_of_trailer(trailer: dict[str, Any]) -> ChunkLayout:
    """The layout a trailer describes; ChunkFormatError if it is incomplete or inconsistent."""
    try:
        layout = ChunkLayout(kind=str(trailer["kind"]), layer_start=int(trailer["layer_start"]),
                             layer_end=int(trailer["layer_end"]),
                             n_tokens=int(trailer["token_end"]) - int(trailer["token_start"]),
                             num_kv_heads=int(trailer.get("num_kv_heads", 0)), head_dim=int(trailer.get("head_dim", 0)),
                             dtype=str(trailer["dtype"]), quant=str(trailer.get("quant", "none")),
                             hidden_size=int(trailer.get("hidden_size", 0)),
                             heads=HeadRange(*map(int, trailer["heads"])) if "heads" in trailer else None)
    except (KeyError, TypeError, ValueError, BadRequestError) as exc:
        raise ChunkFormatError(f"chunk trailer is incomplete: {exc!r}") from exc
    ids = trailer.get("token_ids")
    if not isinstance(ids, list) or len(ids) != layout.n_tokens:
        raise ChunkFormatError("chunk trailer's token ids do not cover its token range")
    return layout


def _key_of(trailer: dict[str, Any]) -> ChunkKey:
    try:
        return ChunkKey(digest=bytes.fromhex(trailer["key"]), index=0, token_start=int(trailer["token_start"]),
                        token_end=int(trailer["token_end"]))
    except (KeyError, TypeError, ValueError, BadRequestError) as exc:
        raise ChunkFormatError(f"chunk trailer has no valid key: {exc!r}") from exc


def verify_section(buf: memoryview, *, layout: ChunkLayout, layer: int, key: ChunkKey) -> SectionCheck:
    """Check one section (exactly `layout.section_size` bytes) against what the reader expects."""
    if len(buf) != layout.section_size:
        return SectionCheck(False, "truncated")
    return _verify_parts(buf[:SECTION_HEADER_SIZE], [buf[SECTION_HEADER_SIZE:]], layout=layout, layer=layer, key=key)


def _verify_parts(header: memoryview, payload: Sequence[memoryview], *, layout: ChunkLayout, layer: int,
                  key: ChunkKey) -> SectionCheck:
    """Check a section given as its header and its payload's bytes in order (in one piece or several)."""
    magic, s_layer, t0, t1, crc, length, digest = SECTION_HEADER.unpack_from(header, 0)
    if magic != SECTION_MAGIC:
        return SectionCheck(False, "magic")
    if digest != key.digest:
        return SectionCheck(False, "key")
    if s_layer != layer:
        return SectionCheck(False, "layer")
    if (t0, t1) != (key.token_start, key.token_end) or length != layout.payload_size:
        return SectionCheck(False, "tokens")
    if HEAD_FIELDS.unpack_from(header, SECTION_HEADER.size) != layout.head_fields:
        return SectionCheck(False, "heads")
    value = 0
    for part in payload:
        value = crc32(part, value)  # releases the GIL on large buffers
    return OK if value == crc else SectionCheck(False, "crc")


def float32_to_bfloat16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 [..., D] -> bfloat16 bytes [..., D * 2], rounded to nearest even as torch's .to(bfloat16) does."""
    return float32_to_bfloat16_bits(x).view(np.uint8)


def _payload_bytes(payload: memoryview, layout: ChunkLayout) -> np.ndarray:
    """A verified section payload as the target dtype's bytes: uint8 [2, Hkv, T, D * itemsize] (numpy only)."""
    h, t, d = layout.num_kv_heads, layout.n_tokens, layout.head_dim
    if layout.quant == "none":
        return np.frombuffer(payload, dtype=np.uint8).reshape(2, h, t, d * ITEMSIZE[layout.dtype])
    q = np.frombuffer(payload, dtype=np.int8, count=2 * h * t * d).reshape(2, h, t, d)  # [2, Hkv, T, D]
    scales = np.frombuffer(payload, dtype="<f4", offset=2 * h * t * d).reshape(2, h, t)  # [2, Hkv, T]
    return float32_to_dtype_bytes(dequantize_int8_np(q, scales), layout.dtype)  # [2, Hkv, T, D * itemsize]


def _check_landing(layout: ChunkLayout, layers: range, dst: np.ndarray, dst_layer_start: int,
                   token_start: int, n_heads: int = 0) -> None:
    """BadRequestError when the caller's destination or layer range cannot take these sections (`n_heads` of
    their heads; 0: all)."""
    if layout.kind != "kv":
        raise BadRequestError(f"only kv chunks land in a KV buffer, not {layout.kind!r}")
    if layers.step != 1 or not layout.layer_start <= layers.start < layers.stop <= layout.layer_end:
        raise BadRequestError(f"layers {layers} are not a non-empty run within [{layout.layer_start}, "
                              f"{layout.layer_end})")
    row, heads = layout.head_dim * ITEMSIZE[layout.dtype], n_heads or layout.num_kv_heads
    if dst.dtype != np.uint8 or dst.ndim != 5 or dst.shape[1:3] != (2, heads) or dst.shape[4] != row:
        raise BadRequestError(f"dst must be uint8 [layers, 2, {heads}, capacity, {row}], got {dst.dtype} {dst.shape}")
    if not (dst_layer_start <= layers.start and layers.stop - dst_layer_start <= dst.shape[0]
            and 0 <= token_start <= dst.shape[3] - layout.n_tokens):
        raise BadRequestError(f"layers {layers} / tokens [{token_start}, {token_start + layout.n_tokens}) fall "
                              f"outside a buffer of layers from {dst_layer_start} with shape {dst.shape}")


def land_kv_sections(buf: memoryview, *, layout: ChunkLayout, key: ChunkKey, layers: range, dst: np.ndarray,
                     dst_layer_start: int, token_start: int, take: slice | None = None) -> SectionCheck:
    """Verify every section of `layers` in `buf`, then copy them into `dst`; nothing is written on failure.
    `take`: the chunk's heads (indices among its own) that land, dst holding just those (None: all).

    buf: the contiguous sections of `layers` (absolute), as read from `layout.section_offset(layers.start)`.
    dst: uint8 view of a KV buffer holding layers from `dst_layer_start`, [n_buf_layers, 2, Hkv, capacity,
    D * itemsize] (`kv.data.view(torch.uint8).numpy()`). Tokens land at [token_start, token_start + T).
    A bad section is a miss (the returned check); a destination that cannot fit is a BadRequestError.
    numpy and `checksum.crc32` only: safe to run next to the forward pass.
    """
    take = take or slice(0, layout.num_kv_heads)
    if not 0 <= take.start < take.stop <= layout.num_kv_heads or take.step not in (None, 1):
        raise BadRequestError(f"heads {take} are not a run of the chunk's {layout.num_kv_heads}")
    _check_landing(layout, layers, dst, dst_layer_start, token_start, take.stop - take.start)
    mv = memoryview(buf).cast("B")
    size = layout.section_size
    if len(mv) != size * len(layers):
        return SectionCheck(False, "truncated")
    for i, layer in enumerate(layers):
        check = verify_section(mv[i * size : (i + 1) * size], layout=layout, layer=layer, key=key)
        if not check.ok:
            return check
    t1 = token_start + layout.n_tokens
    for i, layer in enumerate(layers):
        payload = mv[i * size + SECTION_HEADER_SIZE : (i + 1) * size]
        kept = _payload_bytes(payload, layout)[:, take]  # [2, h, T, D * itemsize]: the heads dst holds
        dst[layer - dst_layer_start, :, :, token_start:t1, :] = kept
    return OK


def kv_landing_views(layout: ChunkLayout, layer: int, dst: np.ndarray, dst_layer_start: int, token_start: int,
                     header: memoryview) -> list[memoryview]:
    """Where the bytes of layer `layer`'s section go when a read lands them straight in a KV buffer: its
    header into `header` (`SECTION_HEADER_SIZE` bytes), its payload [2, Hkv, T, D * itemsize] into the rows
    of `dst` (as `land_kv_sections`), one view per (K or V, head): no staging buffer, no copy.

    Only for unquantized chunks (int8 ones are dequantized on landing). The bytes land unchecked: check
    them with `verify_landed`; a unit whose check fails holds whatever arrived, as a unit not yet loaded.
    """
    if layout.quant != "none":
        raise BadRequestError("int8 chunks are dequantized on landing: read them into a staging buffer")
    _check_landing(layout, range(layer, layer + 1), dst, dst_layer_start, token_start)
    rows = dst[layer - dst_layer_start, :, :, token_start : token_start + layout.n_tokens]  # [2, Hkv, T, D*isz]
    return [header[:SECTION_HEADER_SIZE]] + [memoryview(rows[kv, head]).cast("B")  # [T * D * itemsize]
                                             for kv in range(2) for head in range(layout.num_kv_heads)]


def verify_landed(views: list[memoryview], *, layout: ChunkLayout, layer: int, key: ChunkKey) -> SectionCheck:
    """Check a section that `kv_landing_views` landed (its views, header first), as `verify_section` does."""
    return _verify_parts(views[0], views[1:], layout=layout, layer=layer, key=key)


# ---------------------------------------------------------------------------------------------- decoding


def _parse(obj: bytes | memoryview, kind: str) -> tuple[dict[str, Any], ChunkLayout, ChunkKey, memoryview]:
    """Trailer, layout, key and the sections of a whole object, checked for consistency with each other."""
    mv = memoryview(obj).cast("B")
    trailer = read_trailer(mv)
    layout, key = layout_of_trailer(trailer), _key_of(trailer)
    if layout.kind != kind:
        raise ChunkFormatError(f"expected a {kind} chunk, got {layout.kind!r}")
    if len(mv) != layout.sections_size + _trailer_span(mv) + TRAILER_TAIL.size:
        raise ChunkFormatError(f"chunk object has {len(mv)} bytes, its trailer describes another size")
    return trailer, layout, key, mv[: layout.sections_size]


def decode_kv_chunk(obj: bytes | memoryview) -> tuple[dict[str, Any], torch.Tensor]:
    """A whole kv object -> (trailer, [n_layers, 2, Hkv, T, D] tensor, dequantized); ChunkFormatError on any failure."""
    trailer, layout, key, sections = _parse(obj, "kv")
    out = np.zeros((layout.n_layers, 2, layout.num_kv_heads, layout.n_tokens,
                    layout.head_dim * ITEMSIZE[layout.dtype]), np.uint8)  # [L, 2, Hkv, T, D * itemsize]
    check = land_kv_sections(sections, layout=layout, key=key, layers=range(layout.layer_start, layout.layer_end),
                             dst=out, dst_layer_start=layout.layer_start, token_start=0)
    if not check.ok:
        raise ChunkFormatError(f"chunk section invalid: {check.reason}")
    return trailer, torch.from_numpy(out).view(TORCH_DTYPES[layout.dtype])  # [L, 2, Hkv, T, D]


def decode_hidden_chunk(obj: bytes | memoryview) -> tuple[dict[str, Any], torch.Tensor]:
    """A whole hidden object -> (trailer, [T, hidden_size] tensor); ChunkFormatError on any failure."""
    trailer, layout, key, section = _parse(obj, "hidden")
    check = verify_section(section, layout=layout, layer=layout.layer_start, key=key)
    if not check.ok:
        raise ChunkFormatError(f"hidden chunk invalid: {check.reason}")
    raw = np.frombuffer(section[SECTION_HEADER_SIZE:], dtype=np.uint8).copy()  # [T * hidden * itemsize]
    hidden = torch.from_numpy(raw).view(TORCH_DTYPES[layout.dtype])  # [T * hidden]
    return trailer, hidden.reshape(layout.n_tokens, layout.hidden_size)  # [T, hidden]
