"""The stage's KV pool: a fixed budget of blocks of its layers' KV, handed out per request.

Each request gets one KV buffer sized to whole blocks (prefix + suffix + tokens to generate, as the
request says); the pool accounts in blocks, refuses a request that does not fit (the caller retries
later or elsewhere) and takes the blocks back on release. No tenant may hold more than
`tenant_max_blocks` at once, so one tenant's requests cannot take the pool from all the others.
Buffers are contiguous per request, which is what the restore's loader and the attention kernels
read fastest. The pool keys nothing by request: each request's record holds its grant (`PoolGrant`).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass

from cacheflow_common.errors import CacheFlowError
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer


class PoolFullError(CacheFlowError):
    """The KV pool has no room for a request now (HTTP 503: retry later)."""


@dataclass(frozen=True)
class PoolGrant:
    """One request's share of the pool (held in its record, `requests.StageRequest`): its blocks and the KV
    buffer over them."""

    tenant: str
    blocks: int
    kv: KVBuffer


class KVPool:
    def __init__(self, model: Transformer, layers: range, *, capacity_tokens: int, block_tokens: int,
                 tenant_share: float = 1.0) -> None:
        self.model = model
        self.layers = layers
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self.tenant_max_blocks = max(1, int(self.capacity_blocks * tenant_share))
        self._tenant_blocks: Counter[str] = Counter()  # tenant -> blocks its requests hold (claimed first)
        self._grants = 0  # grants handed out and not given back
        self._lock = threading.Lock()

    @property
    def used_blocks(self) -> int:
        with self._lock:
            return self._tenant_blocks.total()

    @property
    def free_blocks(self) -> int:
        with self._lock:
            return self.capacity_blocks - self._tenant_blocks.total()

    def blocks_for(self, n_tokens: int) -> int:
        return -(-max(1, n_tokens) // self.block_tokens)

    def grant(self, n_tokens: int, *, tenant: str = "") -> PoolGrant:
        """A KV buffer for at least `n_tokens` tokens of this stage's layers; PoolFullError if no room (in
        the pool, or within the tenant's share of it)."""
        blocks = self.blocks_for(n_tokens)
        with self._lock:
            free = self.capacity_blocks - self._tenant_blocks.total()
            if blocks > free:
                raise PoolFullError(f"KV pool full: {blocks} blocks asked, {free} free")
            held = self._tenant_blocks[tenant]
            if held + blocks > self.tenant_max_blocks:
                raise PoolFullError(f"tenant {tenant!r} holds {held} of its {self.tenant_max_blocks} blocks: "
                                    f"{blocks} more do not fit")
            self._tenant_blocks[tenant] += blocks
            self._grants += 1
        try:
            kv = self.model.new_kv(self.layers, blocks * self.block_tokens)
        except BaseException:
            self._return(tenant, blocks)
            raise
        return PoolGrant(tenant, blocks, kv)

    def give_back(self, grant: PoolGrant) -> None:
        self._return(grant.tenant, grant.blocks)

    def requests(self) -> int:
        """Grants held now (one per admitted request)."""
        with self._lock:
            return self._grants

    def _return(self, tenant: str, blocks: int) -> None:
        with self._lock:
            self._tenant_blocks[tenant] -= blocks
            self._grants -= 1
