"""Rotary position embeddings, as Hugging Face computes them (default, linear and Llama-3 scaling)."""

from __future__ import annotations

import math

import torch

from cacheflow_common.model.config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.scaling == "linear":
        return inv / rope.factor
    if rope.scaling == "llama3":
        return _llama3(inv, rope)
    return inv


def _llama3(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    old = rope.original_max_position_embeddings
    low_wavelen = old / rope.low_freq_factor
    high_wavelen = old / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryTable:
    """cos/sin per position, grown on demand; one per model and device (no global state)."""

    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        self.inv = inv_frequencies(rope, head_dim).to(device)  # [D/2]
        self.cos = torch.empty(0, head_dim, device=device)
        self.sin = torch.empty(0, head_dim, device=device)

    def _grow(self, n: int) -> None:
        n = max(n, 2 * self.cos.shape[0], 1024)  # amortized growth
        pos = torch.arange(n, dtype=torch.float32, device=self.inv.device)
        freqs = torch.outer(pos, self.inv)  # [n, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, D]
        self.cos, self.sin = emb.cos(), emb.sin()

    def at(self, start: int, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for positions [start, end): each [T, D] in `dtype`."""
        if end > self.cos.shape[0]:
            self._grow(end)
        return self.cos[start:end].to(dtype), self.sin[start:end].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [H, T, D], cos/sin [T, D] -> [H, T, D]."""
    return x * cos + rotate_half(x) * sin
