"""Restores on tensor-parallel ranks: every chunk loaded, none recomputed.

Recomputing with vLLM's model on a rank runs its tensor-parallel collectives, so every rank would have to
run the same forwards in the same order; the two-pointer restore decides how far compute goes as loads
land, differently on each rank, and a rank that computed one unit more would wait forever on the others.
So a tensor-parallel rank loads its own chunks (its slice of the KV heads, keyed by its rank) front to
back and stops at the first that misses; vLLM recomputes from there, on every rank together.
"""

from __future__ import annotations

from typing import NamedTuple

from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.vllm_connector.block_kv import BlockKV


class Loaded(NamedTuple):
    end: int  # tokens [0, end) are in the blocks
    chunks: int  # chunks loaded
    bytes_read: int
    miss: str  # why the chunk at `end` missed, or "" (all loaded)


def load_prefix(job: RestoreJob, store: ChunkStore, kv: BlockKV, *, start: int) -> Loaded:
    """Load the job's chunks from position `start` on into `kv`, in order, until one misses; then copy them
    into the blocks."""
    loader = KVLoader(store=store, keys=job.keys, layers=job.layers, kv=kv, dtype=job.kv_dtype, quant=job.quant)
    end, loaded, miss = start, 0, ""
    for unit, key in enumerate(job.keys):
        if key.token_end <= start:
            continue  # vLLM's own prefix-cache hit holds it
        miss = loader.load_chunk(unit)
        if miss:
            break
        end, loaded = key.token_end, loaded + 1
    kv.sync(end)
    return Loaded(end, loaded, loader.bytes_read, miss)
