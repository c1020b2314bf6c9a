"""How much of a prompt's prefix the storage pods hold: the longest run of whole chunks stored for every stage.

A chunk counts only if every stage's KV object for it is stored (a stage missing one would recompute
it, and everything after it on the stages that compute from it). Partial chunks are not looked up: a
new prompt's chunk at that position has other tokens, so its key differs. The lookup is one small
data-plane request per chunk and stage, `WINDOW` chunks' worth in flight at once (one after another,
a long prompt's lookup would cost hundreds of round trips to busy pods); it stops at the first window
with a chunk missing. The restore itself re-checks every object it reads (a chunk evicted or
corrupted in between is recomputed).

With `boundaries`, a chunk also needs each later stage's boundary activation (a vLLM pipeline rank restores
only from it; a stage worker can fall back to a pipelined restore, so the coordinator does not ask). With
`draft_rows`, it needs the rows a speculative draft reads too (without them, a restore that reruns the draft ends
before the chunk).

Under tensor parallelism each rank stores its KV heads as objects of their own (`head_sources.py`): a chunk
counts if its heads are stored split the instance's way, or (looked up only for a chunk missing so) any
other way (one split for every stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from cacheflow_common.kv.keys import ChunkKey, HeadRange, chunk_keys, object_name, tenant_salt
from cacheflow_common.restore.boundary import boundary_name
from cacheflow_common.restore.head_sources import head_splits
from cacheflow_common.store.base import ChunkStore

WINDOW = 16  # chunks looked up at once
_LOOKUPS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="prefix-lookup")


def cached_prefix_tokens(token_ids: Sequence[int], *, fingerprint: str, tenant: str, chunk_size: int,
                         stage_layers: Sequence[range], store: ChunkStore, limit: int, kv_heads: int = 0,
                         head_split: int = 1, boundaries: bool = False,
                         draft_rows: Sequence[tuple[int, str]] = ()) -> int:
    """Tokens [0, n) of `token_ids` whose KV is stored for every stage, n a multiple of the chunk size <= limit.

    `head_split`: how many runs the instance splits the model's `kv_heads` into (its tensor-parallel ranks'
    objects); a chunk not stored that way counts if every stage's heads are stored split some other way
    (0 `kv_heads`: not looked for). `boundaries`: the stages after the first need their boundary activations
    too; `draft_rows`: the rows a speculative draft reads too, each (layer, kind) as stored (an EAGLE or MTP
    draft's: the model's output rows at its layer count; an EAGLE-3 draft's: the boundary activations entering
    its auxiliary layers)."""
    keys = [k for k in chunk_keys(token_ids[: max(0, limit)], chunk_size, tenant_salt(fingerprint, tenant))
            if k.n_tokens == chunk_size]
    own = _split(kv_heads, head_split)
    others = [n for n in head_splits(kv_heads) if n != head_split] if kv_heads else []
    later = [layers.start for layers in stage_layers[1:]] if boundaries else []
    cached = 0
    for first in range(0, len(keys), WINDOW):
        window = keys[first : first + WINDOW]
        # per key, two groups in one round of requests: its KV objects (the instance's split), its boundaries
        groups = [(_names(key, stage_layers, own), _boundary_names(key, later, draft_rows)) for key in window]
        found = iter(_all_stored([group for pair in groups for group in pair], store))
        for key, kv_stored, boundaries_stored in zip(window, found, found, strict=True):
            if not boundaries_stored or not (kv_stored or any(_all_stored(
                    [_names(key, stage_layers, _split(kv_heads, n)) for n in others], store))):  # split another way
                return cached
            cached = key.token_end
    return cached


def _split(kv_heads: int, n: int) -> list[HeadRange | None]:
    """The runs of heads of a split n (heads not known: [None], the object of all heads)."""
    return [*HeadRange(0, kv_heads, kv_heads).parts(n)] if kv_heads else [None]


def _names(key: ChunkKey, stage_layers: Sequence[range], runs: list[HeadRange | None]) -> list[str]:
    return [object_name(key, "kv", r.start, r.stop, heads) for r in stage_layers for heads in runs]


def _boundary_names(key: ChunkKey, layers: Sequence[int], rows: Sequence[tuple[int, str]]) -> list[str]:
    """The chunk's boundary activations entering each of `layers`, and its `rows` (layer, kind)."""
    return [boundary_name(key, layer) for layer in layers] + [boundary_name(key, layer, kind) for layer, kind in rows]


def _all_stored(groups: list[list[str]], store: ChunkStore) -> list[bool]:
    """For each group of names, whether the store holds every one (one round of requests for all)."""
    found = iter(_LOOKUPS.map(store.exists, [name for group in groups for name in group]))
    return [all([next(found) for _ in group]) for group in groups]
