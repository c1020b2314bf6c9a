"""The chunk object format: self-verifying sections, whole and ranged reads, damage detection, int8 landing."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from cacheflow_common.errors import BadRequestError, ChunkFormatError
from cacheflow_common.kv.chunk import (
    SECTION_HEADER_SIZE,
    ChunkLayout,
    decode_hidden_chunk,
    decode_kv_chunk,
    encode_hidden_chunk,
    encode_kv_chunk,
    kv_landing_views,
    land_kv_sections,
    layout_of_trailer,
    read_trailer,
    verify_landed,
    verify_section,
)
from cacheflow_common.kv.keys import ChunkKey, chunk_keys, tenant_salt
from cacheflow_common.kv.quant import dequantize_int8, quantize_int8
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.store.filesystem import FilesystemStore
from cacheflow_common.store.memory import MemoryStore

SALT = tenant_salt("model-fp", "tenant-a")
L0, L1, H, T, D = 2, 5, 2, 7, 8  # a stage of layers [2, 5), 2 KV heads, 7 tokens, head_dim 8
IDS = list(range(100, 100 + 3 * T))  # a 3-chunk prefix; the tests use its middle chunk, tokens [7, 14)


def _kv(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L1 - L0, 2, H, T, D, generator=g).to(dtype)  # [L, 2, Hkv, T, D]


def _layout(dtype: str, quant: str = "none") -> ChunkLayout:
    return ChunkLayout(kind="kv", layer_start=L0, layer_end=L1, n_tokens=T, num_kv_heads=H, head_dim=D,
                       dtype=dtype, quant=quant)


def _key() -> ChunkKey:
    return chunk_keys(IDS, T, SALT)[1]


def _encode(kv: torch.Tensor, dtype: str, quant: str = "none") -> bytes:
    key = _key()
    return bytes(encode_kv_chunk(key=key, token_ids=IDS[key.token_start : key.token_end], model="m",
                                 layer_start=L0, kv=kv, dtype=dtype, quant=quant))


def _dst(dtype: torch.dtype, capacity: int = 3 * T) -> tuple[torch.Tensor, np.ndarray]:
    buf = torch.zeros(L1 - L0, 2, H, capacity, D, dtype=dtype)  # [L, 2, Hkv, capacity, D]
    return buf, buf.view(torch.uint8).numpy()  # the loader's view: [L, 2, Hkv, capacity, D * itemsize]


def _land(buf: bytes | memoryview, dst: np.ndarray, layout: ChunkLayout, layers: range = range(L0, L1),
          key: ChunkKey | None = None):
    return land_kv_sections(memoryview(buf), layout=layout, key=key or _key(), layers=layers, dst=dst,
                            dst_layer_start=L0, token_start=7)


def test_layout_arithmetic_and_object_shape():
    layout = _layout("bfloat16")
    assert layout.payload_size == 2 * H * T * D * 2 and layout.section_size == 64 + layout.payload_size
    assert layout.sections_size == 3 * layout.section_size and layout.section_offset(4) == 2 * layout.section_size
    assert _layout("float32", "int8").payload_size == 2 * H * T * D + 2 * H * T * 4
    obj = _encode(_kv(torch.bfloat16), "bfloat16")
    trailer = read_trailer(obj)
    assert trailer["token_ids"] == IDS[7:14] and trailer["key"] == _key().hex and trailer["layer_end"] == L1
    assert layout_of_trailer(trailer) == layout
    assert len(obj) == layout.sections_size + len(trailer_json(obj)) + 12 and obj.endswith(b"CFKVEND1")
    for layer in range(L0, L1):  # every header names its layer, tokens and key
        magic, s_layer, t0, t1, _, length, digest = struct.unpack_from("<4sIIIIQ16s", obj, layout.section_offset(layer))
        assert (magic, s_layer, t0, t1, length, digest) == (b"CFS1", layer, 7, 14, layout.payload_size, _key().digest)
    with pytest.raises(BadRequestError):
        layout.section_offset(L1)
    for bad in ({"dtype": "int4"}, {"quant": "fp8"}, {"num_kv_heads": 0}, {"layer_end": L0}, {"kind": "x"}):
        with pytest.raises(ChunkFormatError):
            ChunkLayout(**{**_layout("float32").__dict__, **bad})


def trailer_json(obj: bytes) -> bytes:
    (length,) = struct.unpack_from("<I", obj, len(obj) - 12)
    return obj[len(obj) - 12 - length : len(obj) - 12]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_whole_chunk_round_trip_is_exact(dtype):
    tdt = getattr(torch, dtype)
    kv = _kv(tdt)
    obj, layout = _encode(kv, dtype), _layout(dtype)
    buf, dst = _dst(tdt)
    assert _land(memoryview(obj)[: layout.sections_size], dst, layout).ok
    assert torch.equal(buf[..., 7:14, :], kv)
    assert not buf[..., :7, :].any() and not buf[..., 14:, :].any()
    trailer, decoded = decode_kv_chunk(obj)
    assert torch.equal(decoded, kv) and trailer["dtype"] == dtype


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_chunks_carry_the_caches_bytes_exactly(dtype):
    """An fp8 cache's chunk is its bytes (uint8, as vLLM allocates fp8 caches), whatever their values."""
    n = (L1 - L0) * 2 * H * T * D
    kv = (torch.arange(n) * 37 % 256).to(torch.uint8).view(L1 - L0, 2, H, T, D)  # [L, 2, Hkv, T, D]
    obj, layout = _encode(kv, dtype), _layout(dtype)
    buf, dst = _dst(torch.uint8)
    assert _land(memoryview(obj)[: layout.sections_size], dst, layout).ok
    assert torch.equal(buf[..., 7:14, :], kv) and len(set(kv.flatten().tolist())) == min(n, 256)
    trailer, decoded = decode_kv_chunk(obj)
    assert torch.equal(decoded, kv) and decoded.dtype == torch.uint8 and trailer["dtype"] == dtype
    with pytest.raises(BadRequestError):
        _encode(kv.float(), dtype)  # values, not the cache's bytes


@pytest.fixture(params=["memory", "filesystem"])
def store(request, tmp_path: Path) -> ChunkStore:
    return MemoryStore() if request.param == "memory" else FilesystemStore(tmp_path / "s")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("layers", [range(3, 4), range(3, 5), range(L0, L1)])
def test_ranged_read_of_some_layers_lands_exactly_those(store, dtype, layers):
    tdt = getattr(torch, dtype)
    kv, layout = _kv(tdt), _layout(dtype)
    store.put("c", _encode(kv, dtype))
    section = memoryview(bytearray(layout.section_size * len(layers)))
    assert store.read_into("c", section, layout.section_offset(layers.start))
    buf, dst = _dst(tdt)
    assert _land(section, dst, layout, layers).ok
    for layer in range(L0, L1):
        got = buf[layer - L0]
        if layer in layers:
            assert torch.equal(got[..., 7:14, :], kv[layer - L0]) and not got[..., 14:, :].any()
        else:
            assert not got.any()
    if len(layers) < L1 - L0:  # the same bytes offered as other layers are refused
        other = range(layers.start - 1, layers.stop - 1)
        buf.zero_()
        assert _land(section, dst, layout, other).reason == "layer" and not buf.any()


@pytest.mark.parametrize(("offset_in_section", "reason"), [(100, "crc"), (0, "magic"), (30, "key"), (4, "layer"),
                                                           (8, "tokens"), (16, "crc"), (24, "tokens")])
def test_damage_is_detected_and_nothing_is_written(offset_in_section, reason):
    layout = _layout("float32")
    obj = bytearray(_encode(_kv(torch.float32), "float32"))
    obj[layout.section_offset(4) + offset_in_section] ^= 0x55  # the last layer's section: earlier ones are fine
    buf, dst = _dst(torch.float32)
    check = _land(memoryview(obj)[: layout.sections_size], dst, layout)
    assert not check.ok and check.reason == reason
    assert not buf.any()
    with pytest.raises(ChunkFormatError):
        decode_kv_chunk(bytes(obj))


def _read_direct(store: ChunkStore, name: str, dst: np.ndarray, layout: ChunkLayout, layer: int,
                 key: ChunkKey | None = None) -> str:
    """One layer's section read straight into `dst` (as the loader lands chunks), then checked in place."""
    views = kv_landing_views(layout, layer, dst, L0, 7, memoryview(bytearray(SECTION_HEADER_SIZE)))
    if not store.readv_into(name, views, layout.section_offset(layer)):
        return "absent"
    return verify_landed(views, layout=layout, layer=layer, key=key or _key()).reason


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sections_read_straight_into_the_kv_buffer_land_exactly_and_damage_is_caught(store, dtype):
    kv, layout = _kv(getattr(torch, dtype), seed=5), _layout(dtype)
    store.put("c", _encode(kv, dtype))
    buf, dst = _dst(getattr(torch, dtype))
    for layer in range(L0, L1):
        assert _read_direct(store, "c", dst, layout, layer) == ""
    assert torch.equal(buf[:, :, :, 7:14], kv)  # [L, 2, Hkv, T, D]: bit-exact, no staging copy
    assert _read_direct(store, "c", dst, layout, L0, key=chunk_keys(IDS, T, SALT)[2]) == "key"
    damaged = bytearray(_encode(kv, dtype))
    damaged[layout.section_offset(3) + SECTION_HEADER_SIZE + 5] ^= 0x55
    store.put("d", bytes(damaged))
    assert _read_direct(store, "d", dst, layout, 3) == "crc"
    with pytest.raises(BadRequestError):  # int8 chunks are dequantized on landing: never read straight in
        kv_landing_views(_layout(dtype, "int8"), L0, dst, L0, 7, memoryview(bytearray(SECTION_HEADER_SIZE)))


def test_another_chunks_bytes_are_refused():
    layout = _layout("float32")
    obj = _encode(_kv(torch.float32), "float32")
    buf, dst = _dst(torch.float32)
    other_tenant = chunk_keys(IDS, T, tenant_salt("model-fp", "tenant-b"))[1]
    assert _land(memoryview(obj)[: layout.sections_size], dst, layout, key=other_tenant).reason == "key"
    neighbour = chunk_keys(IDS, T, SALT)[2]  # same length, next chunk of the same prefix
    assert _land(memoryview(obj)[: layout.sections_size], dst, layout, key=neighbour).reason == "key"
    assert not buf.any()


def test_a_reader_expecting_another_layout_misses():
    obj = _encode(_kv(torch.float32), "float32", quant="int8")
    _, dst = _dst(torch.float32)
    layout = _layout("float32")  # the reader expects unquantized sections: sizes differ
    size = layout.section_size
    assert _land(memoryview(obj)[:size], dst, layout, range(L0, L0 + 1)).reason == "tokens"
    section = memoryview(obj)[:size]
    assert verify_section(section, layout=layout, layer=L0, key=_key()).reason == "tokens"
    assert verify_section(section[:-1], layout=layout, layer=L0, key=_key()).reason == "truncated"


def test_truncated_objects_are_misses_or_format_errors(store):
    layout = _layout("float32")
    obj = _encode(_kv(torch.float32), "float32")
    _, dst = _dst(torch.float32)
    short = memoryview(obj)[: layout.sections_size - 1]
    assert _land(short, dst, layout).reason == "truncated"
    store.put("cut", obj[: layout.sections_size - 10])
    assert not store.read_into("cut", memoryview(bytearray(layout.sections_size)), 0)  # a short object: a miss
    for cut in (obj[:-3], obj[: layout.sections_size], obj[5:], b"", b"CFKVEND1"):
        with pytest.raises(ChunkFormatError):
            decode_kv_chunk(cut)
    broken_json = obj[: -12 - 5] + b"xxxxx" + obj[-12:]
    with pytest.raises(ChunkFormatError):
        read_trailer(broken_json)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_int8_lands_exactly_as_torch_dequantizes(dtype):
    tdt = getattr(torch, dtype)
    kv = _kv(tdt)
    obj, layout = _encode(kv, dtype, quant="int8"), _layout(dtype, "int8")
    assert layout.sections_size < _layout(dtype).sections_size or dtype != "float32"
    buf, dst = _dst(tdt)
    assert _land(memoryview(obj)[: layout.sections_size], dst, layout).ok
    q, s = quantize_int8(kv)
    assert torch.equal(buf[..., 7:14, :], dequantize_int8(q, s, tdt))  # numpy landing == torch's own rounding
    ref = kv.float()
    rel_rms = float((buf[..., 7:14, :].float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert rel_rms < 0.01
    assert torch.equal(decode_kv_chunk(obj)[1], buf[..., 7:14, :])


def test_landing_calls_no_torch_function():
    calls: list[str] = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    for quant in ("none", "int8"):
        layout = _layout("bfloat16", quant)
        obj = _encode(_kv(torch.bfloat16), "bfloat16", quant)
        _, dst = _dst(torch.bfloat16)
        with Record():
            assert _land(memoryview(obj)[: layout.sections_size], dst, layout).ok
    assert calls == []


def test_numpy_byte_view_encodes_like_the_tensor():
    kv = _kv(torch.bfloat16)
    view = kv.view(torch.uint8).numpy()  # [L, 2, Hkv, T, D * 2]
    assert _encode(view, "bfloat16") == _encode(kv, "bfloat16")  # type: ignore[arg-type]
    padded = torch.zeros(L1 - L0, 2, H, 3 * T, D, dtype=torch.bfloat16)
    padded[..., 7:14, :] = kv
    strided = padded.view(torch.uint8).numpy()[..., 7:14, :]  # a non-contiguous window of a KV buffer
    assert _encode(strided, "bfloat16") == _encode(kv, "bfloat16")  # type: ignore[arg-type]


def test_strided_tensors_encode_like_their_contiguous_copies():
    """Encoding copies a window of a KV buffer (or a tensor whose last dimension is strided) in place."""
    kv = _kv(torch.float32)
    padded = torch.zeros(L1 - L0, 2, H, 3 * T, D)
    padded[..., 7:14, :] = kv
    assert _encode(padded[..., 7:14, :], "float32") == _encode(kv, "float32")
    transposed = kv.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, stride(-1) == T
    assert transposed.stride(-1) != 1 and _encode(transposed, "float32") == _encode(kv, "float32")


def test_bad_encode_arguments_are_rejected():
    kv, key = _kv(torch.float32), _key()
    ids = IDS[7:14]
    for kwargs in ({"kv": kv.half()}, {"kv": kv[:, :, :, :5]}, {"token_ids": ids[:3]}, {"quant": "fp8"},
                   {"dtype": "int8"}, {"kv": kv[0]}, {"kv": kv.numpy()}, {"layer_start": -1}):
        args = {"key": key, "token_ids": ids, "model": "m", "layer_start": L0, "kv": kv, "dtype": "float32"}
        with pytest.raises(BadRequestError):
            encode_kv_chunk(**{**args, **kwargs})  # type: ignore[arg-type]


def test_bad_destinations_are_caller_errors():
    layout = _layout("float32")
    obj = memoryview(_encode(_kv(torch.float32), "float32"))[: layout.sections_size]
    _, dst = _dst(torch.float32)
    small = _dst(torch.float32, capacity=10)[1]
    with pytest.raises(BadRequestError):
        land_kv_sections(obj, layout=layout, key=_key(), layers=range(L0, L1), dst=small, dst_layer_start=L0,
                         token_start=7)  # tokens [7, 14) do not fit in 10
    with pytest.raises(BadRequestError):
        land_kv_sections(obj, layout=layout, key=_key(), layers=range(L0, L1 + 1), dst=dst, dst_layer_start=L0,
                         token_start=7)
    with pytest.raises(BadRequestError):
        land_kv_sections(obj, layout=layout, key=_key(), layers=range(L0, L1), dst=dst.view(np.float32),
                         dst_layer_start=L0, token_start=7)
    with pytest.raises(BadRequestError):
        land_kv_sections(obj, layout=layout, key=_key(), layers=range(L0, L1), dst=dst, dst_layer_start=L0 + 1,
                         token_start=7)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_hidden_chunk_round_trip(dtype):
    key = _key()
    hidden = torch.randn(T, 32).to(getattr(torch, dtype))  # [T, hidden]
    obj = encode_hidden_chunk(key=key, token_ids=IDS[7:14], model="m", layer=3, hidden=hidden, dtype=dtype)
    trailer, got = decode_hidden_chunk(obj)
    assert trailer["kind"] == "hidden" and trailer["layer_start"] == 3 and torch.equal(got, hidden)
    layout = layout_of_trailer(trailer)
    assert layout.sections_size == 64 + T * 32 * hidden.element_size()
    assert verify_section(memoryview(obj)[: layout.section_size], layout=layout, layer=3, key=key).ok
    with pytest.raises(ChunkFormatError):
        decode_kv_chunk(obj)  # a hidden object is not a kv object
    with pytest.raises(ChunkFormatError):
        decode_hidden_chunk(_encode(_kv(torch.float32), "float32"))
    damaged = bytearray(obj)
    damaged[SECTION_HEADER_SIZE + 3] ^= 1
    with pytest.raises(ChunkFormatError):
        decode_hidden_chunk(bytes(damaged))
