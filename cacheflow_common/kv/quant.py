"""Symmetric int8 quantization of KV, one scale per token and head (over head_dim).

    scale[..., t] = max_d |x[..., t, d]| / 127        q = round_half_even(x / scale), in [-127, 127]

Quantizing runs on the save path and may use torch. Dequantizing has a numpy twin
(`dequantize_int8_np` + `float32_to_dtype_bytes`) for the loader thread, which must not call torch
ops while the forward pass runs; both twins do the same float32 math, so they give the same bits.
"""

from __future__ import annotations

import numpy as np
import torch

_MIN_SCALE = 1e-12  # an all-zero row keeps a positive scale, so quantizing never divides by zero
_BF16_QUIET_NAN = np.uint16(0x7FC0)  # the canonical quiet NaN (torch's scalar conversion writes it too)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., T, D] -> (int8 [..., T, D], float32 scales [..., T]) with scale = max|x| / 127."""
    xf = x.float()  # [..., T, D]
    scales = (xf.abs().amax(dim=-1) / 127.0).clamp_min(_MIN_SCALE)  # [..., T]
    q = torch.round(xf / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)  # [..., T, D]
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(int8 [..., T, D], float32 [..., T]) -> [..., T, D] of `dtype` (float32 math, then one rounding)."""
    return (q.float() * scales.unsqueeze(-1)).to(dtype)  # [..., T, D]


def dequantize_int8_np(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The numpy twin of `dequantize_int8` before its final cast: float32 [..., T, D]."""
    return q.astype(np.float32) * scales.astype(np.float32, copy=False)[..., None]  # [..., T, D]


def float32_to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16, same shape), round to nearest even, as torch's .to(bfloat16)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)  # [...]
    lsb = (u >> np.uint32(16)) & np.uint32(1)  # ties go to the even bfloat16
    bits = ((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)  # [...]; overflow rounds to inf
    nan = np.isnan(x)
    if nan.any():  # a NaN's low mantissa bits could otherwise round up into infinity
        bits[nan] = _BF16_QUIET_NAN | (bits[nan] & np.uint16(0x8000))
    return bits


def float32_to_dtype_bytes(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 [..., D] -> the bytes of `dtype` ("float32" | "float16" | "bfloat16"): uint8 [..., D * itemsize]."""
    if dtype == "float32":
        return np.ascontiguousarray(x, dtype=np.float32).view(np.uint8)
    if dtype == "float16":
        return x.astype(np.float16).view(np.uint8)  # numpy rounds to nearest even, as torch does
    if dtype == "bfloat16":
        return float32_to_bfloat16_bits(x).view(np.uint8)
    raise ValueError(f"no byte conversion to {dtype!r}")


def int8_error(x: torch.Tensor) -> dict[str, float]:
    """How much an int8 round trip changes `x` [..., T, D], measured in float32.

    max_abs: largest absolute error; rel_rms: RMS error / RMS of x; rel_max: max_abs / max |x|.
    """
    xf = x.float()  # [..., T, D]
    q, s = quantize_int8(xf)
    err = dequantize_int8(q, s, torch.float32) - xf  # [..., T, D]
    rms = float(xf.pow(2).mean().sqrt())
    peak = float(xf.abs().max()) if xf.numel() else 0.0
    max_abs = float(err.abs().max()) if err.numel() else 0.0
    return {
        "max_abs": max_abs,
        "rel_rms": float(err.pow(2).mean().sqrt()) / max(rms, _MIN_SCALE),
        "rel_max": max_abs / max(peak, _MIN_SCALE),
    }
