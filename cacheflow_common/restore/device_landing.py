"""Landing loaded KV in GPU memory: verified bytes go to a pinned host buffer, then one copy on the loader's stream.

The loader thread never touches the compute stream: each unit's host-to-device copy runs on a stream of
its own and is waited for before the unit is reported loaded, so the compute pointer (which waits for
its own work after every unit) only ever reads KV that is complete.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cacheflow_common.model.kv_buffer import KVBuffer


class DeviceLanding:
    """A pinned host staging area shaped like a token range or one layer of a GPU `KVBuffer`."""

    def __init__(self, kv: KVBuffer, max_bytes: int) -> None:
        self.kv = kv
        self._pinned = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=True)  # [max_bytes]
        self._stream = torch.cuda.Stream(device=kv.data.device)

    def tokens_target(self, n_tokens: int) -> np.ndarray:
        """uint8 [n_layers, 2, Hkv, n_tokens, D * itemsize]: land a chunk here at token 0, layer `kv.layer_start`."""
        n_layers, _, heads, _, head_dim = self.kv.data.shape
        return self._host((n_layers, 2, heads, n_tokens, head_dim)).view(torch.uint8).numpy()

    def layer_target(self, n_tokens: int) -> np.ndarray:
        """uint8 [1, 2, Hkv, n_tokens, D * itemsize]: land one layer of tokens [0, n_tokens) here."""
        _, _, heads, _, head_dim = self.kv.data.shape
        return self._host((1, 2, heads, n_tokens, head_dim)).view(torch.uint8).numpy()

    def push_tokens(self, start: int, end: int) -> None:
        """Copy what `tokens_target(end - start)` holds to tokens [start, end) of every layer; waits for it."""
        n_layers, _, heads, _, head_dim = self.kv.data.shape
        self._copy(self.kv.data[:, :, :, start:end], self._host((n_layers, 2, heads, end - start, head_dim)))

    def push_layer(self, layer: int, n_tokens: int) -> None:
        """Copy what `layer_target(n_tokens)` holds to tokens [0, n_tokens) of absolute `layer`; waits for it."""
        _, _, heads, _, head_dim = self.kv.data.shape
        dst = self.kv.layer(layer)[None, :, :, :n_tokens]  # [1, 2, Hkv, T, D]
        self._copy(dst, self._host((1, 2, heads, n_tokens, head_dim)))

    def _host(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The pinned buffer's front as a KV-dtype tensor of `shape`."""
        nbytes = math.prod(shape) * self.kv.data.element_size()
        return self._pinned[:nbytes].view(self.kv.data.dtype).view(shape)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()  # the pinned buffer is reused by the next unit
