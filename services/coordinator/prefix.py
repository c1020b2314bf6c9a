"""How much of a prompt's prefix the storage pods hold: the longest run of whole chunks stored for every stage.

A chunk counts only if every stage's KV object for it is stored (a stage missing one would recompute
it, and everything after it on the stages that compute from it). Partial chunks are not looked up: a
new prompt's chunk at that position has other tokens, so its key differs. The lookup is one small
data-plane request per chunk and stage; the restore itself re-checks every object it reads (a chunk
evicted or corrupted in between is recomputed).
"""

from __future__ import annotations

from collections.abc import Sequence

from cacheflow_common.kv.keys import chunk_keys, object_name, tenant_salt
from cacheflow_common.store.base import ChunkStore


def cached_prefix_tokens(token_ids: Sequence[int], *, fingerprint: str, tenant: str, chunk_size: int,
                         stage_layers: Sequence[range], store: ChunkStore, limit: int) -> int:
    """Tokens [0, n) of `token_ids` whose KV is stored for every stage, n a multiple of the chunk size <= limit."""
    cached = 0
    for key in chunk_keys(token_ids[: max(0, limit)], chunk_size, tenant_salt(fingerprint, tenant)):
        if key.n_tokens < chunk_size:
            break
        if not all(store.exists(object_name(key, "kv", r.start, r.stop)) for r in stage_layers):
            break
        cached = key.token_end
    return cached
