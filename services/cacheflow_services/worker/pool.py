"""The stage's KV pool: a fixed budget of blocks of its layers' KV, handed out per request.

Each request gets one KV buffer sized to whole blocks (prefix + suffix + tokens to generate, as the
request says); the pool accounts in blocks, refuses a request that does not fit (the caller retries
later or elsewhere) and takes the blocks back on release. No tenant may hold more than
`tenant_max_blocks` at once, so one tenant's requests cannot take the pool from all the others.
Buffers are contiguous per request, which is what the restore's loader and the attention kernels
read fastest.
"""

from __future__ import annotations

import threading

from cacheflow_common.errors import CacheFlowError
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer


class PoolFullError(CacheFlowError):
    """The KV pool has no room for a request now (HTTP 503: retry later)."""


class KVPool:
    def __init__(self, model: Transformer, layers: range, *, capacity_tokens: int, block_tokens: int,
                 tenant_share: float = 1.0) -> None:
        self.model = model
        self.layers = layers
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self.tenant_max_blocks = max(1, int(self.capacity_blocks * tenant_share))
        self._blocks: dict[str, int] = {}  # request id -> blocks held (claimed before the buffer exists)
        self._tenants: dict[str, str] = {}  # request id -> its tenant
        self._buffers: dict[str, KVBuffer] = {}
        self._lock = threading.Lock()

    @property
    def used_blocks(self) -> int:
        with self._lock:
            return sum(self._blocks.values())

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return self.capacity_blocks - sum(self._blocks.values())

    def blocks_for(self, n_tokens: int) -> int:
        return -(-max(1, n_tokens) // self.block_tokens)

    def allocate(self, request_id: str, n_tokens: int, *, tenant: str = "") -> KVBuffer:
        """A KV buffer for at least `n_tokens` tokens of this stage's layers; PoolFullError if no room (in
        the pool, or within the tenant's share of it)."""
        blocks = self.blocks_for(n_tokens)
        with self._lock:
            if request_id in self._blocks:
                raise PoolFullError(f"request {request_id!r} already holds KV on this stage")
            free = self.capacity_blocks - sum(self._blocks.values())
            if blocks > free:
                raise PoolFullError(f"KV pool full: {blocks} blocks asked, {free} free")
            held = sum(b for r, b in self._blocks.items() if self._tenants.get(r) == tenant)
            if held + blocks > self.tenant_max_blocks:
                raise PoolFullError(f"tenant {tenant!r} holds {held} of its {self.tenant_max_blocks} blocks: "
                                    f"{blocks} more do not fit")
            self._blocks[request_id] = blocks
            self._tenants[request_id] = tenant
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
            self._tenants.pop(request_id, None)
            return self._blocks.pop(request_id, None) is not None

    def requests(self) -> int:
        with self._lock:
            return len(self._blocks)
