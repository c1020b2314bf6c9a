"""Chunk keys and the chunk object format: chaining, self-verifying sections, ranged reads, int8."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cacheflow_common.errors import BadRequestError, ChunkFormatError
from cacheflow_common.kv.chunk import (
    ChunkLayout,
    decode_hidden_chunk,
    decode_kv_chunk,
    encode_hidden_chunk,
    encode_kv_chunk,
    float32_to_bfloat16_bytes,
    land_kv_sections,
    read_trailer,
)
from cacheflow_common.kv.keys import chunk_keys, object_name, tenant_salt
from cacheflow_common.kv.quant import int8_error
from cacheflow_common.store.memory import MemoryStore

SALT = tenant_salt("model-fp", "tenant-a")
L0, L1, H, T, D = 2, 5, 2, 7, 8  # a stage of layers [2, 5), 2 KV heads, 7 tokens, head_dim 8


def test_keys_chain_over_the_whole_prefix():
    ids = list(range(40))
    keys = chunk_keys(ids, 16, SALT)
    assert [(k.token_start, k.token_end) for k in keys] == [(0, 16), (16, 32), (32, 40)]
    assert keys == chunk_keys(ids, 16, SALT)
    changed = chunk_keys([*ids[:20], 999, *ids[21:]], 16, SALT)
    assert changed[0] == keys[0] and changed[1].digest != keys[1].digest and changed[2].digest != keys[2].digest
    # Chaining: equal last-chunk tokens after a different history give a different key.
    assert chunk_keys([1, *ids[1:]], 16, SALT)[2].digest != keys[2].digest
    assert chunk_keys(ids, 16, tenant_salt("model-fp", "tenant-b"))[0].digest != keys[0].digest
    assert chunk_keys(ids, 16, tenant_salt("other-model", "tenant-a"))[0].digest != keys[0].digest
    assert chunk_keys([], 16, SALT) == []


def test_keys_reject_bad_input():
    with pytest.raises(BadRequestError):
        chunk_keys([1, 2], 0, SALT)
    with pytest.raises(BadRequestError):
        chunk_keys([-1], 4, SALT)


def _kv(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L1 - L0, 2, H, T, D, generator=g).to(dtype)  # [L, 2, Hkv, T, D]


def _layout(dtype: str, quant: str = "none") -> ChunkLayout:
    return ChunkLayout(kind="kv", layer_start=L0, layer_end=L1, n_tokens=T, num_kv_heads=H, head_dim=D,
                       dtype=dtype, quant=quant)


def _key():
    return chunk_keys(list(range(3 * T)), T, SALT)[1]  # tokens [7, 14)


def _dst(dtype: torch.dtype, capacity: int = 3 * T) -> tuple[torch.Tensor, np.ndarray]:
    buf = torch.zeros(L1 - L0, 2, H, capacity, D, dtype=dtype)
    return buf, buf.view(torch.uint8).numpy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_whole_chunk_round_trip_is_exact(dtype):
    tdt = getattr(torch, dtype)
    kv, key = _kv(tdt), _key()
    obj = encode_kv_chunk(key=key, token_ids=list(range(7, 14)), model="m", layer_start=L0, kv=kv, dtype=dtype)
    trailer = read_trailer(obj)
    assert trailer["token_ids"] == list(range(7, 14)) and trailer["layer_start"] == L0
    layout = _layout(dtype)
    assert len(obj) > layout.sections_size
    buf, dst = _dst(tdt)
    check = land_kv_sections(memoryview(obj)[: layout.sections_size], layout=layout, key=key,
                             layers=range(L0, L1), dst=dst, dst_layer_start=L0, token_start=key.token_start)
    assert check.ok
    assert torch.equal(buf[..., 7:14, :], kv)
    assert not buf[..., :7, :].any() and not buf[..., 14:, :].any()
    assert torch.equal(decode_kv_chunk(obj)[1], kv)


def test_one_layer_by_ranged_read():
    kv, key = _kv(torch.bfloat16), _key()
    store = MemoryStore()
    store.put("c", encode_kv_chunk(key=key, token_ids=list(range(7, 14)), model="m", layer_start=L0, kv=kv,
                                   dtype="bfloat16"))
    layout = _layout("bfloat16")
    buf, dst = _dst(torch.bfloat16)
    section = memoryview(bytearray(layout.section_size))
    assert store.read_into("c", section, layout.section_offset(3))
    assert land_kv_sections(section, layout=layout, key=key, layers=range(3, 4), dst=dst, dst_layer_start=L0,
                            token_start=7).ok
    assert torch.equal(buf[1, ..., 7:14, :], kv[1]) and not buf[0].any() and not buf[2].any()
    # The wrong layer's bytes for this layer are refused.
    assert land_kv_sections(section, layout=layout, key=key, layers=range(4, 5), dst=dst, dst_layer_start=L0,
                            token_start=7).reason == "layer"


@pytest.mark.parametrize(("offset_in_section", "reason"), [(100, "crc"), (0, "magic"), (30, "key")])
def test_damage_is_detected_and_nothing_is_written(offset_in_section, reason):
    kv, key = _kv(torch.float32), _key()
    obj = bytearray(encode_kv_chunk(key=key, token_ids=list(range(7, 14)), model="m", layer_start=L0, kv=kv,
                                    dtype="float32"))
    layout = _layout("float32")
    obj[layout.section_offset(4) + offset_in_section] ^= 0x55  # the last layer's section
    buf, dst = _dst(torch.float32)
    check = land_kv_sections(memoryview(obj)[: layout.sections_size], layout=layout, key=key,
                             layers=range(L0, L1), dst=dst, dst_layer_start=L0, token_start=7)
    assert not check.ok and check.reason == reason
    assert not buf.any()
    with pytest.raises(ChunkFormatError):
        decode_kv_chunk(bytes(obj))


def test_another_chunks_bytes_are_refused():
    kv, keys = _kv(torch.float32), chunk_keys(list(range(3 * T)), T, SALT)
    obj = encode_kv_chunk(key=keys[1], token_ids=list(range(7, 14)), model="m", layer_start=L0, kv=kv,
                          dtype="float32")
    layout = _layout("float32")
    _, dst = _dst(torch.float32)
    wrong = chunk_keys(list(range(3 * T)), T, tenant_salt("model-fp", "tenant-b"))[1]
    check = land_kv_sections(memoryview(obj)[: layout.sections_size], layout=layout, key=wrong,
                             layers=range(L0, L1), dst=dst, dst_layer_start=L0, token_start=7)
    assert check.reason == "key"


def test_truncated_objects_are_refused():
    kv, key = _kv(torch.float32), _key()
    obj = encode_kv_chunk(key=key, token_ids=list(range(7, 14)), model="m", layer_start=L0, kv=kv, dtype="float32")
    layout = _layout("float32")
    _, dst = _dst(torch.float32)
    short = memoryview(obj)[: layout.sections_size - 1]
    assert land_kv_sections(short, layout=layout, key=key, layers=range(L0, L1), dst=dst, dst_layer_start=L0,
                            token_start=7).reason == "truncated"
    with pytest.raises(ChunkFormatError):
        read_trailer(obj[:-3])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_int8_payload_lands_dequantized(dtype):
    tdt = getattr(torch, dtype)
    kv, key = _kv(tdt), _key()
    obj = encode_kv_chunk(key=key, token_ids=list(range(7, 14)), model="m", layer_start=L0, kv=kv, dtype=dtype,
                          quant="int8")
    layout = _layout(dtype, "int8")
    assert layout.sections_size < _layout(dtype).sections_size
    buf, dst = _dst(tdt)
    assert land_kv_sections(memoryview(obj)[: layout.sections_size], layout=layout, key=key, layers=range(L0, L1),
                            dst=dst, dst_layer_start=L0, token_start=7).ok
    got, ref = buf[..., 7:14, :].float(), kv.float()
    rel_rms = float((got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
    assert rel_rms < 0.01
    assert int8_error(torch.randn(4, 64, 128))["rel_rms"] < 0.01


def test_bfloat16_rounding_matches_torch():
    x = torch.randn(1000) * torch.logspace(-20, 20, 1000)
    ours = float32_to_bfloat16_bytes(x.numpy())
    assert np.array_equal(ours, x.to(torch.bfloat16).view(torch.uint8).numpy())


def test_hidden_chunk_round_trip():
    key = _key()
    hidden = torch.randn(T, 32).to(torch.bfloat16)
    obj = encode_hidden_chunk(key=key, token_ids=list(range(7, 14)), model="m", layer=3, hidden=hidden,
                              dtype="bfloat16")
    trailer, got = decode_hidden_chunk(obj)
    assert trailer["kind"] == "hidden" and torch.equal(got, hidden)


def test_object_names_are_safe():
    key = _key()
    assert object_name(key, "kv", 0, 4) == f"{key.hex}.kv.L0-4"
    with pytest.raises(BadRequestError):
        object_name(key, "../x", 0, 4)
