"""A restore's KV in the request's own blocks of vLLM's cache, with no buffer of its own: vLLM's attention
layers write what vLLM's model recomputes (`vllm_runtime.py`) straight into the blocks, in the cache's own
layout and dtype, and the loader writes each loaded chunk there as it lands (`BlockLanding`), so a unit that
attends over a loaded chunk finds it in the blocks.

Positions before `first_writable` are vLLM's own prefix-cache hit: its blocks hold them (and may be shared
with other requests), so they are never written.

The blocks are vLLM's: once a load is reported to vLLM, it may schedule the request, or free its blocks and
give them to another. So the connector seals the buffer before it reports (`seal`): a load still in flight
then (of a restore that failed or was cancelled) writes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

import torch

from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.restore.device_landing import StagedLanding
from cacheflow_services.vllm_connector.paged import gather_layers, scatter, scatter_bytes
from cacheflow_services.vllm_connector.plan import Adapter


class BlockKV(KVBuffer):
    def __init__(self, *, layers: range, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 caches: Mapping[int, torch.Tensor], layout: str, block_ids: Sequence[int], block_size: int,
                 first_writable: int, adapter: Adapter | None = None) -> None:
        """`caches`: vLLM's cache of each of `layers`; `block_ids`: the request's blocks from position 0;
        `adapter`: the request's LoRA adapter, which vLLM's model recomputes its KV under (None: the base model)."""
        self.caches = {layer: caches[layer] for layer in layers}
        device = next(iter(self.caches.values())).device
        # no KV of its own: `data` only tells the loader the KV's shape, dtype and device
        super().__init__(layer_start=layers.start, layer_end=layers.stop, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, capacity=0, dtype=dtype, device=device)  # data: [L, 2, Hkv, 0, D]
        self.capacity = capacity
        self.layout = layout
        self.block_ids = tuple(block_ids)
        self.block_size = block_size
        self.first_writable = first_writable
        self.adapter = adapter
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._lock = threading.Lock()  # one write at a time, and none after `seal`
        self._sealed = False
        self._outputs: dict[int, torch.Tensor] | None = None  # first position -> rows vLLM's model returned there
        self.draft_bytes_read = 0  # the bytes of its draft's input rows read from storage (`read_draft_rows`)

    def keep_outputs(self) -> None:
        """Keep the output rows of the forwards that compute this request's positions (`keep`): an EAGLE draft
        restores from them (draft.py)."""
        self._outputs = {}

    def keep(self, start: int, rows: torch.Tensor) -> None:
        """vLLM's model returned `rows` [T, hidden] for positions [start, start + T), or they were read with the
        chunk loaded there (a load thread's); kept if asked for, until `seal`."""
        if self._outputs is None:  # not asked for (`rows` may be what a pipeline rank sends on, not rows)
            return
        rows = rows.clone()
        with self._lock:
            if not self._sealed:
                self._outputs[start] = rows

    def read_draft_rows(self, n_bytes: int) -> None:
        """Count `n_bytes` read from storage for this request's draft rows (on a load thread or vLLM's)."""
        with self._lock:
            self.draft_bytes_read += n_bytes

    def outputs(self, start: int, end: int) -> torch.Tensor | None:
        """The kept output rows of positions [start, end), [end - start, hidden], or None unless all were kept."""
        with self._lock:
            kept = sorted((self._outputs or {}).items())
        parts, at = [], start
        for first, rows in kept:
            if first <= at < first + len(rows):
                parts.append(rows[at - first : min(len(rows), end - first)])
                at += len(parts[-1])
            if at >= end:
                return torch.cat(parts)
        return None

    def landing(self) -> BlockLanding:
        return BlockLanding(self)

    def seal(self) -> None:
        with self._lock:
            self._sealed = True

    def attend(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("vLLM's attention layers attend over a BlockKV's blocks; CacheFlow's never do")

    def write_loaded(self, layers: range, start: int, kv: torch.Tensor) -> None:
        """Write kv [len(layers), 2, Hkv, T, D] (positions [start, start + T), on the host) into the blocks,
        but not before `first_writable`; nothing once sealed. Done when it returns (on a GPU: waited for on
        a stream of its own)."""
        skip = max(0, min(self.first_writable - start, kv.shape[3]))
        with self._lock:
            if self._sealed or skip == kv.shape[3]:
                return
            for i, layer in enumerate(layers):
                part = kv[i, :, :, skip:]  # [2, Hkv, T - skip, D]
                self._write_layer(self.caches[layer], start + skip, part)
            if self._stream is not None:
                self._stream.synchronize()

    def gather(self, start: int, end: int) -> torch.Tensor:
        """A copy of positions [start, end) of every layer out of the blocks: [L, 2, Hkv, T, D] (to store chunks
        recomputed there)."""
        return gather_layers(self.caches.values(), self.layout, self.block_ids, self.block_size, start, end)

    def _write_layer(self, cache: torch.Tensor, start: int, part: torch.Tensor) -> None:
        if self._stream is None:
            scatter_bytes(cache, self.layout, self.block_ids, self.block_size, start, part)
            return
        with torch.cuda.stream(self._stream):
            scatter(cache, self.layout, self.block_ids, self.block_size, start, part)


class BlockLanding(StagedLanding):
    """Loaded chunks (or layers) into a `BlockKV`'s blocks: each is read and checked in a host area (pinned for
    a GPU cache), then written into the blocks."""

    kv: BlockKV

    def push_tokens(self, staged: torch.Tensor, start: int) -> None:
        self.kv.write_loaded(range(self.kv.layer_start, self.kv.layer_end), start, staged)

    def push_layer(self, staged: torch.Tensor, layer: int) -> None:
        self.kv.write_loaded(range(layer, layer + 1), 0, staged)
