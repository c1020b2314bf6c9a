"""Landing loaded KV where the loader cannot write it directly: verified bytes go to a host staging area
(`StagedLanding`), then one push moves them to where they belong.

`DeviceLanding` pushes into a KV buffer in GPU memory: one copy on the loader's own stream, from pinned
memory. The loader thread never touches the compute stream: each unit's copy is waited for before the unit
is reported loaded, so the compute pointer (which waits for its own work after every unit) only ever reads
KV that is complete. (The vLLM connector's `BlockLanding` pushes into the request's blocks of vLLM's cache.)
"""

from __future__ import annotations

import math

import numpy as np
import torch

from cacheflow_common.model.kv_buffer import KVBuffer


class StagedLanding:
    """A host staging area shaped like a token range or one layer of `kv` (pinned when `kv` is in GPU memory).
    Subclasses push what a target holds: `push_tokens(start, end)`, `push_layer(layer, n_tokens)`."""

    def __init__(self, kv: KVBuffer, max_bytes: int) -> None:
        self.kv = kv
        self._staged = torch.empty(max_bytes, dtype=torch.uint8, pin_memory=kv.data.is_cuda)  # [max_bytes]

    def tokens_target(self, n_tokens: int) -> np.ndarray:
        """uint8 [n_layers, 2, Hkv, n_tokens, D * itemsize]: land a chunk here at token 0, layer `kv.layer_start`."""
        return self.tokens(n_tokens).view(torch.uint8).numpy()

    def layer_target(self, n_tokens: int) -> np.ndarray:
        """uint8 [1, 2, Hkv, n_tokens, D * itemsize]: land one layer of tokens [0, n_tokens) here."""
        return self.layer_tokens(n_tokens).view(torch.uint8).numpy()

    def tokens(self, n_tokens: int) -> torch.Tensor:
        """What `tokens_target(n_tokens)` holds, in the KV dtype: [n_layers, 2, Hkv, n_tokens, D]."""
        n_layers, _, heads, _, head_dim = self.kv.data.shape
        return self._host((n_layers, 2, heads, n_tokens, head_dim))

    def layer_tokens(self, n_tokens: int) -> torch.Tensor:
        """What `layer_target(n_tokens)` holds, in the KV dtype: [1, 2, Hkv, n_tokens, D]."""
        _, _, heads, _, head_dim = self.kv.data.shape
        return self._host((1, 2, heads, n_tokens, head_dim))

    def push_tokens(self, start: int, end: int) -> None:
        raise NotImplementedError

    def push_layer(self, layer: int, n_tokens: int) -> None:
        raise NotImplementedError

    def _host(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The staging area's front as a KV-dtype tensor of `shape`."""
        nbytes = math.prod(shape) * self.kv.data.element_size()
        return self._staged[:nbytes].view(self.kv.data.dtype).view(shape)


class DeviceLanding(StagedLanding):
    """Into a GPU `KVBuffer`, by a copy on the loader's own stream."""

    def __init__(self, kv: KVBuffer, max_bytes: int) -> None:
        super().__init__(kv, max_bytes)
        self._stream = torch.cuda.Stream(device=kv.data.device)

    def push_tokens(self, start: int, end: int) -> None:
        """Copy what `tokens_target(end - start)` holds to tokens [start, end) of every layer; waits for it."""
        self._copy(self.kv.data[:, :, :, start:end], self.tokens(end - start))

    def push_layer(self, layer: int, n_tokens: int) -> None:
        """Copy what `layer_target(n_tokens)` holds to tokens [0, n_tokens) of absolute `layer`; waits for it."""
        dst = self.kv.layer(layer)[None, :, :, :n_tokens]  # [1, 2, Hkv, T, D]
        self._copy(dst, self.layer_tokens(n_tokens))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()  # the pinned buffer is reused by the next unit
