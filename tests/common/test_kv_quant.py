"""int8 quantization: measured error, the per-row bound, and the numpy twin's bit-exactness with torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cacheflow_common.kv.quant import (
    dequantize_int8,
    dequantize_int8_np,
    float32_to_bfloat16_bits,
    float32_to_dtype_bytes,
    int8_error,
    quantize_int8,
)


def _normal(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_int8_error_on_normal_data_is_small():
    x = _normal(2, 4, 256, 64)  # [2, Hkv, T, D]
    err = int8_error(x)
    # Measured: rel_rms 0.0059 (D=64) to 0.0065 (D=128), max_abs 0.018 on unit normals: the bound has margin.
    assert err["rel_rms"] < 0.01
    assert err["rel_max"] <= 1 / 254 + 1e-6  # |error| <= scale / 2 = max|x| / 254, for every row
    assert err["max_abs"] > 0


def test_every_element_is_within_half_a_step_of_its_row():
    x = _normal(2, 3, 50, 96, seed=1) * torch.logspace(-3, 3, 50).unsqueeze(-1)  # rows of very different scale
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == x.shape[:-1]
    assert int(q.abs().max()) <= 127
    err = (dequantize_int8(q, s, torch.float32) - x).abs()  # [2, 3, 50, 96]
    assert bool((err <= s.unsqueeze(-1) * (0.5 + 1e-5)).all())


def test_zero_rows_round_trip_to_zero():
    x = torch.zeros(2, 4, 8)
    q, s = quantize_int8(x)
    assert not q.any() and bool((s > 0).all())
    assert not dequantize_int8(q, s, torch.bfloat16).any()
    assert int8_error(x)["max_abs"] == 0.0


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_numpy_twin_gives_torch_bits(dtype):
    x = _normal(2, 4, 33, 64, seed=2) * 3
    q, s = quantize_int8(x)
    ours = float32_to_dtype_bytes(dequantize_int8_np(q.numpy(), s.numpy()), dtype)  # [2, 4, 33, 64 * itemsize]
    ref = dequantize_int8(q, s, getattr(torch, dtype)).view(torch.uint8).numpy()
    assert np.array_equal(ours, ref)


def test_bfloat16_rounding_matches_torch_everywhere():
    rng = np.random.default_rng(3)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)  # every kind of float32
    special = np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x00000001, 0x3F808000, 0x3F818000,
                        0x7F800001, 0xFFFFFFFF, 0x7FC00000], dtype=np.uint32)  # zeros, infs, max, ties, NaNs
    x = np.concatenate([bits, special]).view(np.float32)
    ours = float32_to_bfloat16_bits(x)
    ref = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(x)  # NaN payload bits differ between torch's own scalar and vector paths: check NaN-ness
    assert np.array_equal(ours[~nan], ref[~nan])
    assert bool(torch.from_numpy(ours[nan].view(np.int16)).view(torch.bfloat16).isnan().all())
