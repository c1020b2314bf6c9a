"""A restore's KV when vLLM's own model recomputes it (`vllm_runtime.py`): computed positions are written by
vLLM's attention layers straight into the request's blocks, in the cache's own layout; loaded chunks land in
this buffer (where CacheFlow's loader puts them) and are copied into the blocks before anything attends over
them, and at the end. `in_blocks` says which positions the blocks hold already.

Positions before `first_writable` are vLLM's own prefix-cache hit: its blocks hold them (and may be shared
with other requests), so they are never written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_services.vllm_connector.paged import gather, scatter


class BlockKV(KVBuffer):
    def __init__(self, *, layers: range, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 caches: Mapping[int, torch.Tensor], layout: str, block_ids: Sequence[int], block_size: int,
                 first_writable: int) -> None:
        """`caches`: vLLM's cache of each of `layers`; `block_ids`: the request's blocks from position 0."""
        super().__init__(layer_start=layers.start, layer_end=layers.stop, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, capacity=capacity, dtype=dtype)
        self.caches = {layer: caches[layer] for layer in layers}
        self.layout = layout
        self.block_ids = tuple(block_ids)
        self.block_size = block_size
        self.in_blocks = torch.zeros(capacity, dtype=torch.bool)  # [capacity]
        self.in_blocks[:first_writable] = True

    def attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("vLLM's attention layers attend over a BlockKV's blocks; CacheFlow's never do")

    def computed(self, start: int, end: int) -> None:
        """vLLM's model wrote positions [start, end) of every layer into the blocks."""
        self.in_blocks[start:end] = True

    def sync(self, end: int) -> None:
        """Copy into the blocks every position in [0, end) that only this buffer holds (loaded chunks)."""
        for start, stop in _runs((~self.in_blocks[:end]).nonzero().flatten().tolist()):
            for layer, cache in self.caches.items():
                part = self.data[layer - self.layer_start, :, :, start:stop]  # [2, Hkv, T, D]
                scatter(cache, self.layout, self.block_ids, self.block_size, start, part)
            self.in_blocks[start:stop] = True

    def pull(self, start: int, end: int) -> None:
        """Copy positions [start, end) of every layer out of the blocks into this buffer (to store them)."""
        for layer, cache in self.caches.items():
            part = gather(cache, self.layout, self.block_ids, self.block_size, start, end)  # [2, Hkv, T, D]
            self.data[layer - self.layer_start, :, :, start:end] = part.to(self.data.dtype)


def _runs(positions: list[int]) -> list[tuple[int, int]]:
    """Sorted positions as maximal runs [start, stop)."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs
