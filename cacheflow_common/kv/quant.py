"""Symmetric int8 quantization of KV, one scale per token and head (over head_dim)."""

from __future__ import annotations

import torch

_MIN_SCALE = 1e-12  # an all-zero row keeps a positive scale, so dequantizing never divides by zero


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., T, D] -> (int8 [..., T, D], float32 scales [..., T]) with scale = max|x| / 127."""
    xf = x.float()
    scales = (xf.abs().amax(dim=-1) / 127.0).clamp_min(_MIN_SCALE)  # [..., T]
    q = torch.round(xf / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)  # [..., T, D]
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scales.unsqueeze(-1)).to(dtype)  # [..., T, D]


def int8_error(x: torch.Tensor) -> dict[str, float]:
    """How much int8 round-tripping changes `x`: max absolute and relative RMS error."""
    q, s = quantize_int8(x)
    err = dequantize_int8(q, s, torch.float32) - x.float()
    rms = x.float().pow(2).mean().sqrt().clamp_min(_MIN_SCALE)
    return {"max_abs": float(err.abs().max()), "rel_rms": float(err.pow(2).mean().sqrt() / rms)}
