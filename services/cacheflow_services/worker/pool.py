"""The stage's KV pool: a fixed budget of blocks of its layers' KV, handed out per request.

Each request gets one KV buffer sized to whole blocks (prefix + suffix + tokens to generate, as the
request says); the pool accounts in blocks, refuses a request that does not fit (the caller retries
later or elsewhere) and takes the blocks back on release. Buffers are contiguous per request, which
is what the restore's loader and the attention kernels read fastest.
"""

from __future__ import annotations

import threading

from cacheflow_common.errors import CacheFlowError
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer


class PoolFullError(CacheFlowError):
    """The KV pool has no room for a request now (HTTP 503: retry later)."""


class KVPool:
    def __init__(self, model: Transformer, layers: range, *, capacity_tokens: int, block_tokens: int) -> None:
        self.model = model
        self.layers = layers
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: dict[str, int] = {}  # request id -> blocks held (claimed before the buffer exists)
        self._buffers: dict[str, KVBuffer] = {}
        self._lock = threading.Lock()

    @property
    def used_blocks(self) -> int:
        with self._lock:
            return sum(self._blocks.values())

    def allocate(self, request_id: str, n_tokens: int) -> KVBuffer:
        """A KV buffer for at least `n_tokens` tokens of this stage's layers; PoolFullError if no room."""
        blocks = -(-max(1, n_tokens) // self.block_tokens)
        with self._lock:
            if request_id in self._blocks:
                raise PoolFullError(f"request {request_id!r} already holds KV on this stage")
            free = self.capacity_blocks - sum(self._blocks.values())
            if blocks > free:
                raise PoolFullError(f"KV pool full: {blocks} blocks asked, {free} free")
            self._blocks[request_id] = blocks
        try:
            kv = self.model.new_kv(self.layers, blocks * self.block_tokens)
        except BaseException:
            self.release(request_id)
            raise
        with self._lock:
            self._buffers[request_id] = kv
        return kv

    def get(self, request_id: str) -> KVBuffer | None:
        with self._lock:
            return self._buffers.get(request_id)

    def release(self, request_id: str) -> bool:
        with self._lock:
            self._buffers.pop(request_id, None)
            return self._blocks.pop(request_id, None) is not None

    def requests(self) -> int:
        with self._lock:
            return len(self._blocks)
