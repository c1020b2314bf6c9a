"""How much of a prompt's prefix the storage pods hold: the longest run of whole chunks stored for every stage.

A chunk counts only if every stage's KV object for it is stored (a stage missing one would recompute
it, and everything after it on the stages that compute from it). Partial chunks are not looked up: a
new prompt's chunk at that position has other tokens, so its key differs. The lookup is one small
data-plane request per chunk and stage, `WINDOW` chunks' worth in flight at once (one after another,
a long prompt's lookup would cost hundreds of round trips to busy pods); it stops at the first window
with a chunk missing. The restore itself re-checks every object it reads (a chunk evicted or
corrupted in between is recomputed).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from cacheflow_common.kv.keys import chunk_keys, object_name, tenant_salt
from cacheflow_common.store.base import ChunkStore

WINDOW = 16  # chunks looked up at once
_LOOKUPS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="prefix-lookup")


def cached_prefix_tokens(token_ids: Sequence[int], *, fingerprint: str, tenant: str, chunk_size: int,
                         stage_layers: Sequence[range], store: ChunkStore, limit: int) -> int:
    """Tokens [0, n) of `token_ids` whose KV is stored for every stage, n a multiple of the chunk size <= limit."""
    keys = [k for k in chunk_keys(token_ids[: max(0, limit)], chunk_size, tenant_salt(fingerprint, tenant))
            if k.n_tokens == chunk_size]
    cached = 0
    for first in range(0, len(keys), WINDOW):
        window = keys[first : first + WINDOW]
        names = [object_name(key, "kv", r.start, r.stop) for key in window for r in stage_layers]
        found = list(_LOOKUPS.map(store.exists, names))
        for i, key in enumerate(window):
            if not all(found[i * len(stage_layers): (i + 1) * len(stage_layers)]):
                return cached
            cached = key.token_end
    return cached
