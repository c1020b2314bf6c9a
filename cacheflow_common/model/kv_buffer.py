"""A preallocated KV buffer for one request and a contiguous range of layers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.layers import attention

if TYPE_CHECKING:
    from cacheflow_common.restore.device_landing import StagedLanding


class KVBuffer:
    """KV of layers [layer_start, layer_end) for up to `capacity` tokens of one request.

    `data` is [n_layers, 2, num_kv_heads, capacity, head_dim]; index 0 of dim 1 is K (after RoPE),
    1 is V. Token positions are explicit: whoever writes tokens [a, b) writes data[..., a:b, :].
    """

    def __init__(self, *, layer_start: int, layer_end: int, num_kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.layer_start = layer_start
        self.layer_end = layer_end
        self.capacity = capacity
        self.data = torch.zeros(layer_end - layer_start, 2, num_kv_heads, capacity, head_dim, dtype=dtype,
                                device=device)

    @classmethod
    def for_model(cls, config: ModelConfig, *, layers: range, capacity: int, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> KVBuffer:
        return cls(layer_start=layers.start, layer_end=layers.stop, num_kv_heads=config.num_kv_heads,
                   head_dim=config.head_dim, capacity=capacity, dtype=dtype, device=device)

    def landing(self) -> StagedLanding | None:
        """Where the loader lands chunks when it cannot read them straight into `data` (None: the loader's
        default, by the device). A buffer whose KV lives elsewhere says where."""
        return None

    def seal(self) -> None:
        """No load lands in this buffer after this returns (its restore is over). Nothing to do for a buffer of
        its own; one that writes into memory its owner reuses once told the restore ended stops writing there."""

    def attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Write one layer's K/V of positions [start, start + T), then attend over [0, start + T) causally:
        q [H, T, D], k/v [Hkv, T, D] -> [H, T, D]. (Subclasses attend with another kernel over the same KV.)"""
        end = self.write(layer, start, k, v)
        buf = self.layer(layer)  # [2, Hkv, capacity, D]
        keys, values = buf[0, :, :end].to(q.dtype), buf[1, :, :end].to(q.dtype)  # [Hkv, end, D]
        return attention(q, keys, values, start)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Store k/v [Hkv, T, D] at positions [start, start + T) of absolute `layer`; returns start + T."""
        end = start + k.shape[1]
        if end > self.capacity:
            raise ValueError(f"positions up to {end} exceed the KV buffer's capacity {self.capacity}")
        buf = self.layer(layer)  # [2, Hkv, capacity, D]
        buf[0, :, start:end] = k
        buf[1, :, start:end] = v
        return end

    def layer(self, layer: int) -> torch.Tensor:
        """[2, Hkv, capacity, D] view of absolute layer `layer`."""
        if not self.layer_start <= layer < self.layer_end:
            raise IndexError(f"layer {layer} is outside this buffer's [{self.layer_start}, {self.layer_end})")
        return self.data[layer - self.layer_start]
