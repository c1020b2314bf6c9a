"""Moving KV between vLLM's paged per-layer caches and CacheFlow's contiguous [2, Hkv, T, D] layout.

vLLM 0.32 hands every attention layer's cache over as a logical [num_blocks, Hkv, block_size, 2 * D]
view (its physical stride order may differ: `vllm/v1/kv_cache_layout.py`); a token at position p lives in
block `block_ids[p // block_size]` at offset `p % block_size`. Where K and V sit in it depends on the
attention backend:

* `cpu-vec` (vLLM's CPU backend, its `vec`/`vec16` kernels): the backend views a block as
  [Hkv, 2 * block_size, D] and splits it in two along the token axis, K rows first, then V rows; and its
  kernel stores each head's K *transposed*, [D, block_size], while V stays [block_size, D] (measured on
  vLLM 0.32: `tests/vllm/test_vllm_connector.py` compares stored chunks with CacheFlow's own KV).
* `cpu-plain` (the CPU backend's `amx` kernel, bfloat16): the same, but K stays [block_size, D] too.
* `split` (FlashAttention and the other GPU backends): the last dimension is K (first D) then V.

Both functions take positions [start, end) and the request's block ids, and copy (never alias).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from cacheflow_common.errors import ConfigError

LAYOUTS = ("cpu-vec", "cpu-plain", "split")


def check_cache(cache: torch.Tensor, *, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    """ConfigError unless a layer's cache is the [num_blocks, Hkv, block_size, 2 * D] view described above."""
    if tuple(cache.shape[1:]) != (num_kv_heads, block_size, 2 * head_dim) or cache.dim() != 4:
        raise ConfigError(f"unsupported vLLM KV cache shape {tuple(cache.shape)}: the CacheFlow connector "
                          f"expects [blocks, {num_kv_heads}, {block_size}, {2 * head_dim}]")


def _slots(block_ids: Sequence[int], block_size: int, start: int, end: int,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of every position in [start, end): two [T] int64 tensors."""
    pos = torch.arange(start, end, device=device)  # [T]
    blocks = torch.tensor(list(block_ids), dtype=torch.long, device=device)  # [n_blocks]
    return blocks[pos // block_size], pos % block_size


def _cpu_views(cache: torch.Tensor, layout: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of a CPU layer cache, both indexed [block, head, token, dim] (K of `cpu-vec` is a
    transposed view of its [B, Hkv, D, bs] storage)."""
    n_blocks, heads, _, width = cache.shape
    head_dim = width // 2
    halves = cache.view(n_blocks, heads, 2, block_size * head_dim)  # [B, Hkv, 2, bs*D]: K then V
    values = halves[:, :, 1].view(n_blocks, heads, block_size, head_dim)  # [B, Hkv, bs, D]
    if layout == "cpu-vec":
        return halves[:, :, 0].view(n_blocks, heads, head_dim, block_size).transpose(2, 3), values
    return halves[:, :, 0].view(n_blocks, heads, block_size, head_dim), values


def gather(cache: torch.Tensor, layout: str, block_ids: Sequence[int], block_size: int, start: int,
           end: int) -> torch.Tensor:
    """A copy of positions [start, end) of one layer: [2, Hkv, T, D]."""
    blk, off = _slots(block_ids, block_size, start, end, cache.device)
    if layout.startswith("cpu"):
        keys, values = _cpu_views(cache, layout, block_size)  # [B, Hkv, bs, D] each
        k = keys[blk, :, off]  # [T, Hkv, D]
        v = values[blk, :, off]  # [T, Hkv, D]
    else:
        rows = cache[blk, :, off]  # [T, Hkv, 2*D]
        k, v = rows.chunk(2, dim=-1)  # [T, Hkv, D] each
    return torch.stack([k, v]).transpose(1, 2).contiguous()  # [2, Hkv, T, D]


def gather_layers(caches: Iterable[torch.Tensor], layout: str, block_ids: Sequence[int], block_size: int, start: int,
                  end: int) -> torch.Tensor:
    """A copy of positions [start, end) of every layer's cache in `caches`, in order: [L, 2, Hkv, T, D]."""
    return torch.stack([gather(cache, layout, block_ids, block_size, start, end) for cache in caches])


def scatter(cache: torch.Tensor, layout: str, block_ids: Sequence[int], block_size: int, start: int,
            kv: torch.Tensor) -> None:
    """Write kv [2, Hkv, T, D] (positions [start, start + T)) into one layer's cache."""
    end = start + kv.shape[2]
    blk, off = _slots(block_ids, block_size, start, end, cache.device)
    src = kv.to(device=cache.device, dtype=cache.dtype).transpose(1, 2)  # [2, T, Hkv, D]
    if layout.startswith("cpu"):
        keys, values = _cpu_views(cache, layout, block_size)  # [B, Hkv, bs, D] each
        keys[blk, :, off] = src[0]
        values[blk, :, off] = src[1]
    else:
        cache[blk, :, off] = torch.cat([src[0], src[1]], dim=-1)  # [T, Hkv, 2*D]


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def scatter_bytes(cache: torch.Tensor, layout: str, block_ids: Sequence[int], block_size: int, start: int,
                  kv: torch.Tensor) -> None:
    """`scatter` into a CPU cache by numpy copies on the calling thread: no torch op, so a loader thread does
    not start torch's thread pool beside vLLM's forward. kv [2, Hkv, T, D] holds values as the cache does
    (its dtype, or one of the same size: fp8 as uint8); they are copied bit for bit."""
    if cache.device.type != "cpu" or kv.element_size() != cache.element_size():
        raise ConfigError(f"cannot copy {kv.dtype} KV into a {cache.dtype} cache on {cache.device} byte for byte")
    as_int = _SAME_SIZE_INT[cache.element_size()]
    end = start + kv.shape[2]
    pos = np.arange(start, end)  # [T]
    blk, off = np.asarray(block_ids, dtype=np.int64)[pos // block_size], pos % block_size  # [T] each
    src = kv.view(as_int).numpy().transpose(0, 2, 1, 3)  # [2, T, Hkv, D]
    if layout.startswith("cpu"):
        keys, values = (view.numpy() for view in _cpu_views(cache.view(as_int), layout, block_size))  # [B, Hkv, bs, D]
        keys[blk, :, off] = src[0]  # [T, Hkv, D]
        values[blk, :, off] = src[1]
    else:
        rows = cache.view(as_int).numpy()  # [B, Hkv, bs, 2*D]
        head_dim = kv.shape[3]
        rows[blk, :, off, :head_dim] = src[0]
        rows[blk, :, off, head_dim:] = src[1]


DRAFT_MODEL_PREFIX = "draft_model"  # vLLM's prefix for a draft model's modules (its DraftModelProposer)


def draft_layer(layer_name: str, num_layers: int) -> bool:
    """Whether vLLM's attention layer `layer_name` is a speculative draft's, not one of the target's
    `num_layers`: an EAGLE or MTP draft's layers follow the target's ("model.layers.<num_layers>..."), a draft
    model's are under its own prefix (`draft_model_layer`)."""
    return draft_model_layer(layer_name) or layer_index(layer_name) >= num_layers


def draft_model_layer(layer_name: str) -> bool:
    """Whether vLLM's attention layer `layer_name` is a draft model's ("draft_model.model.layers.0...")."""
    return layer_name.split(".")[0] == DRAFT_MODEL_PREFIX


def layer_index(layer_name: str) -> int:
    """The decoder layer of an attention layer's name, e.g. "model.layers.3.self_attn.attn" -> 3."""
    parts = layer_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    raise ConfigError(f"cannot tell the layer index of vLLM attention layer {layer_name!r}")
