"""The compute pointer at vLLM's speed on its CPU backend: attention with vLLM's own kernel over the request's
own paged blocks.

A restore inside vLLM writes its KV twice: into CacheFlow's contiguous buffer (what loads land in, what the
saves and the boundary ranks read) and into the request's vLLM blocks (where the request's KV must end up
anyway). `PagedKV` is that buffer: a `KVBuffer` whose `attend` writes a unit's K/V to both, copies into the
blocks any earlier position that is only in the buffer (a loaded chunk a recomputed miss attends over),
and attends with vLLM's CPU kernel (`cpu_attention_with_kv_cache`, bottom-right causal over the block
table) instead of torch's SDPA with an explicit mask. On 2 CPU cores, at 8,192 tokens in 256-token units
that is 0.18 s per layer against 0.46 s (head dim 64, fp32).

Positions before `first_writable` are vLLM's own prefix-cache hit: its blocks hold them already (and may be
shared with other requests), so they are read, never written. Called on vLLM's thread only (the
connector computes there: `async_loads.py` says why).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_services.vllm_connector.model_identity import KVGeometry

CPU_ISAS = ("vec", "vec16", "amx")  # vLLM's CPU attention kernels whose block layout the connector knows


class PagedKV(KVBuffer):
    def __init__(self, config: ModelConfig | KVGeometry, *, layers: range, capacity: int, dtype: torch.dtype,
                 caches: Mapping[int, torch.Tensor], block_ids: Sequence[int], block_size: int, isa: str,
                 first_writable: int) -> None:
        """A buffer for `layers` and `capacity` tokens; `caches`: vLLM's cache of each of those layers
        ([num_blocks, Hkv, block_size, 2 * D]); `block_ids`: the request's blocks from position 0."""
        if isa not in CPU_ISAS:
            raise ValueError(f"vLLM CPU attention ISA {isa!r} is not one of {CPU_ISAS}")
        super().__init__(layer_start=layers.start, layer_end=layers.stop, num_kv_heads=config.num_kv_heads,
                         head_dim=config.head_dim, capacity=capacity, dtype=dtype)
        self.isa = isa
        self.caches = {layer: _key_value_views(cache, block_size) for layer, cache in caches.items() if layer in layers}
        self.block_table = torch.tensor([list(block_ids)], dtype=torch.int32)  # [1, n_blocks]
        positions = torch.arange(self.capacity)  # [capacity]
        blocks = torch.tensor(list(block_ids), dtype=torch.long)  # [n_blocks]
        self.slots = blocks[positions // block_size] * block_size + positions % block_size  # [capacity]
        self.in_blocks = torch.zeros(self.layer_end - self.layer_start, self.capacity, dtype=torch.bool)
        self.in_blocks[:, :first_writable] = True  # [n_layers, capacity]: vLLM's blocks hold these positions

    def attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [H, T, D], k/v [Hkv, T, D] -> [H, T, D], attending over the blocks' positions [0, start + T)."""
        from vllm import _custom_ops as ops  # only inside vLLM's process

        end = self.write(layer, start, k, v)
        self.fill_blocks(layer, end)
        heads, t, head_dim = q.shape
        query = q.transpose(0, 1).contiguous()  # [T, H, D]
        out = torch.empty_like(query)  # [T, H, D]
        query_start = torch.tensor([0, t], dtype=torch.int32)
        seq_lens = torch.tensor([end], dtype=torch.int32)
        key_cache, value_cache = self.caches[layer]
        schedule = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=heads, num_kv_heads=k.shape[0], head_dim=head_dim, seq_lens=seq_lens,
            dtype=q.dtype, query_start_loc=query_start, causal=True, sliding_window_size=-1, isa=self.isa,
            enable_kv_split=False)
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=query_start,
            seq_lens=seq_lens, scale=head_dim**-0.5, causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=self.block_table, softcap=0.0, scheduler_metadata=schedule, s_aux=None)
        return out.transpose(0, 1)

    def fill_blocks(self, layer: int, end: int) -> None:
        """Copy into the blocks every position in [0, end) of `layer` that only the buffer holds."""
        from vllm import _custom_ops as ops

        i = layer - self.layer_start
        missing = (~self.in_blocks[i, :end]).nonzero().flatten()  # [P] positions
        if not len(missing):
            return
        kv = self.data[i][:, :, missing].transpose(1, 2)  # [2, P, Hkv, D]
        key_cache, value_cache = self.caches[layer]
        ops.cpu_attn_reshape_and_cache(kv[0].contiguous(), kv[1].contiguous(), key_cache, value_cache,
                                       self.slots[missing], self.isa)
        self.in_blocks[i, missing] = True

    def fill_all(self, end: int) -> None:
        """Every layer's positions [0, end) into the blocks: the restore's result, where vLLM reads it."""
        for layer in range(self.layer_start, self.layer_end):
            self.fill_blocks(layer, end)


def _key_value_views(cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V halves of a CPU layer cache, as vLLM's CPU backend views them: [B, Hkv, block_size, D]
    each (the kernel lays a block's K out its own way inside its half)."""
    n_blocks, heads, _, width = cache.shape
    key_cache, value_cache = cache.view(n_blocks, heads, 2 * block_size, width // 2).chunk(2, dim=2)
    return key_cache, value_cache
