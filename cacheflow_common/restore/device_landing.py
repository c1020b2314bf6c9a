"""Landing loaded KV where the loader cannot read it into place: the bytes land in a host area shaped like
the unit (`StagedLanding`), are checked there, then one push moves them to where they belong.

Unquantized chunks are read straight into an area (the store scatters each section's payload into its rows:
no staging copy); int8 ones are dequantized into it from the raw bytes. Each reader takes an area of its own
for one unit (`tokens_area`, `layer_area`), just the unit's size: several channels loading units of one
request at once do not wait for each other, and a restore holds as many areas as it had loads at once,
freed with it.

`DeviceLanding` pushes into a KV buffer in GPU memory: one copy on the loader's own stream, from pinned
memory. The loader thread never touches the compute stream: each unit's copy is waited for before the unit
is reported loaded (and before its area is reused), so the compute pointer (which waits for its own work
after every unit) only ever reads KV that is complete. (The vLLM connector's `BlockLanding` pushes into the
request's blocks of vLLM's cache.)
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import torch

from cacheflow_common.model.kv_buffer import KVBuffer


class StagedLanding:
    """Host areas shaped like a token range or one layer of `kv` (pinned when `kv` is in GPU memory). Subclasses
    push what an area holds: `push_tokens(staged, start)`, `push_layer(staged, layer)`."""

    def __init__(self, kv: KVBuffer) -> None:
        self.kv = kv
        self._free: list[torch.Tensor] = []  # areas no reader holds now, uint8 [nbytes] each
        self._lock = threading.Lock()

    def tokens_area(self, n_tokens: int) -> AbstractContextManager[torch.Tensor]:
        """[n_layers, 2, Hkv, n_tokens, D] in the KV dtype, for this reader alone while the block runs."""
        n_layers, _, heads, _, head_dim = self.kv.data.shape
        return self._area((n_layers, 2, heads, n_tokens, head_dim))

    def layer_area(self, n_tokens: int) -> AbstractContextManager[torch.Tensor]:
        """[1, 2, Hkv, n_tokens, D] in the KV dtype (one layer), for this reader alone while the block runs."""
        _, _, heads, _, head_dim = self.kv.data.shape
        return self._area((1, 2, heads, n_tokens, head_dim))

    def push_tokens(self, staged: torch.Tensor, start: int) -> None:
        """Move `staged` [n_layers, 2, Hkv, T, D] to tokens [start, start + T) of every layer; done on return."""
        raise NotImplementedError

    def push_layer(self, staged: torch.Tensor, layer: int) -> None:
        """Move `staged` [1, 2, Hkv, T, D] to tokens [0, T) of absolute `layer`; done on return."""
        raise NotImplementedError

    @contextmanager
    def _area(self, shape: tuple[int, ...]) -> Iterator[torch.Tensor]:
        """A free area large enough (else a new one of just that size), as a KV-dtype tensor of `shape`."""
        nbytes = math.prod(shape) * self.kv.data.element_size()
        with self._lock:
            area = next((a for a in self._free if a.numel() >= nbytes), None)
            if area is not None:
                self._free.remove(area)
        if area is None:
            area = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.kv.data.is_cuda)
        try:
            yield area[:nbytes].view(self.kv.data.dtype).view(shape)
        finally:
            with self._lock:
                self._free.append(area)


class DeviceLanding(StagedLanding):
    """Into a GPU `KVBuffer`, by a copy on the loader's own stream."""

    def __init__(self, kv: KVBuffer) -> None:
        super().__init__(kv)
        self._stream = torch.cuda.Stream(device=kv.data.device)

    def push_tokens(self, staged: torch.Tensor, start: int) -> None:
        self._copy(self.kv.data[:, :, :, start : start + staged.shape[3]], staged)

    def push_layer(self, staged: torch.Tensor, layer: int) -> None:
        self._copy(self.kv.layer(layer)[None, :, :, : staged.shape[3]], staged)  # [1, 2, Hkv, T, D]

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        self._stream.synchronize()  # the area is reused by the next unit
