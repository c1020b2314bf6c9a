"""A speculative draft's own KV stored beside the chunks and loaded with them (`draft_kv.py`): its keys (the
chunk's, the draft's identity, and the token after the chunk where the draft reads it), a round trip out of one
request's blocks into another's over a real store, the first missing chunk ending the load, and the ranks'
agreement on where the draft's rerun starts. The draft's KV as vLLM writes it, loaded into real vLLM, is
tests/bench/test_eagle_restore.py's (and test_draft_model_restore.py's, test_mtp_restore.py's)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cacheflow_common.kv.keys import HeadRange, chunk_keys, object_name, tenant_salt
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.store.memory import MemoryStore
from cacheflow_services.vllm_connector.draft import Restored, restore_drafts
from cacheflow_services.vllm_connector.draft_kv import DraftCaches, draft_key
from cacheflow_services.vllm_connector.plan import LoadSpec

CHUNK, BLOCK, HEADS, DIM = 8, 4, 2, 4
TOKENS = tuple(range(100, 100 + 3 * CHUNK))  # 3 chunks
NEXT = 7  # the token after the prefix
_KV = SimpleNamespace(draft_bytes_read=0)  # a restore's blocks, as restore_drafts reads them


def _keys() -> tuple[Any, ...]:
    return tuple(chunk_keys(TOKENS, CHUNK, tenant_salt("fp", "t")))


def _caches(layers: int = 2, heads: int = HEADS) -> tuple[torch.Tensor, ...]:
    """Random draft caches of 16 blocks each: [blocks, Hkv, block_size, 2 * D], vLLM's CPU `cpu-vec` view."""
    return tuple(torch.randn(16, heads, BLOCK, 2 * DIM) for _ in range(layers))


def _draft(caches: tuple[torch.Tensor, ...], *, shifted: bool = True, identity: str = "eagle|w",
           heads: HeadRange | None = None) -> DraftCaches:
    return DraftCaches(caches=caches, identity=identity, shifted=shifted, heads=heads, kv_dtype="float32",
                       layout="cpu-vec", block_size=BLOCK)


def test_a_shifted_drafts_key_is_the_chunks_with_its_identity_and_the_token_after_it() -> None:
    keys = _keys()
    drafted = _draft(_caches()).keys(keys, TOKENS, NEXT)
    assert drafted == [draft_key(keys[0], "eagle|w", TOKENS[CHUNK]), draft_key(keys[1], "eagle|w", TOKENS[2 * CHUNK]),
                       draft_key(keys[2], "eagle|w", NEXT)]
    assert len({k.digest for k in [*drafted, *keys] if k is not None}) == 6  # none is a chunk's own key
    assert [(k.index, k.token_start, k.token_end) for k in drafted if k] == [(k.index, k.token_start, k.token_end)
                                                                         for k in keys]
    assert _draft(_caches()).keys(keys, TOKENS, NEXT + 1)[2] != drafted[2]  # another continuation: another key
    assert _draft(_caches(), identity="eagle|v").keys(keys, TOKENS, NEXT)[0] != drafted[0]  # another draft
    assert _draft(_caches()).keys(keys, TOKENS, None)[2] is None  # the token after it unknown: no key


def test_a_draft_models_key_does_not_depend_on_the_token_after_the_chunk() -> None:
    draft, keys = _draft(_caches(), shifted=False, identity="draft_model|w"), _keys()
    assert draft.keys(keys, TOKENS, None) == draft.keys(keys, TOKENS, NEXT) == [
        draft_key(key, "draft_model|w", None) for key in keys]


def _stored(draft: DraftCaches, store: MemoryStore, block_ids: list[int], next_token: int | None = NEXT) -> int:
    kv = draft.gather(block_ids, 0, len(TOKENS))  # [Ld, 2, Hkv, N, D]
    return draft.store(store, _keys(), TOKENS, next_token, kv, 0, fingerprint="fp")


def test_the_drafts_kv_stored_out_of_one_requests_blocks_loads_into_anothers() -> None:
    saved, store = _draft(_caches()), MemoryStore()
    assert _stored(saved, store, list(range(6))) > 0
    restoring = _draft(_caches())  # another process's caches, another request's blocks
    job = RestoreJob(token_ids=TOKENS, keys=_keys(), layers=range(3), kv_dtype="float32")
    blocks = list(range(10, 16))
    reached, n_bytes = restoring.load(store, job, start=0, end=len(TOKENS), next_token=NEXT, block_ids=blocks)
    assert reached == len(TOKENS) and n_bytes > 0
    assert torch.equal(restoring.gather(blocks, 0, len(TOKENS)), saved.gather(list(range(6)), 0, len(TOKENS)))


def test_the_load_ends_at_the_first_missing_chunk_and_writes_nothing_before_the_start() -> None:
    saved, store = _draft(_caches()), MemoryStore()
    _stored(saved, store, list(range(6)))
    store.delete(object_name(saved.keys(_keys(), TOKENS, NEXT)[2], "kv", 0, 2))  # type: ignore[arg-type]
    restoring = _draft(_caches())
    before = restoring.gather(list(range(10, 16)), 0, len(TOKENS))
    job = RestoreJob(token_ids=TOKENS, keys=_keys(), layers=range(3), kv_dtype="float32")
    reached, _ = restoring.load(store, job, start=4, end=len(TOKENS), next_token=NEXT, block_ids=list(range(10, 16)))
    assert reached == 2 * CHUNK
    after = restoring.gather(list(range(10, 16)), 0, len(TOKENS))
    assert torch.equal(after[:, :, :, :4], before[:, :, :, :4])  # vLLM's own prefix-cache hit: never written
    assert torch.equal(after[:, :, :, 4 : 2 * CHUNK], saved.gather(list(range(6)), 4, 2 * CHUNK))
    other = restoring.load(store, job, start=0, end=len(TOKENS), next_token=NEXT + 1, block_ids=list(range(10, 16)))
    assert other[0] == 2 * CHUNK  # the last chunk's key is another continuation's: missing too


def test_a_prompt_whose_last_chunk_ends_it_stores_no_draft_kv_for_that_chunk() -> None:
    saved, store = _draft(_caches()), MemoryStore()
    _stored(saved, store, list(range(6)), next_token=None)  # the prompt ends with the chunks: its next is sampled
    job = RestoreJob(token_ids=TOKENS, keys=_keys(), layers=range(3), kv_dtype="float32")
    reached, _ = _draft(_caches()).load(store, job, start=0, end=len(TOKENS), next_token=NEXT,
                                        block_ids=list(range(10, 16)))
    assert reached == 2 * CHUNK


@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_ranks_draft_kv_is_read_by_an_instance_holding_all_heads(rank: int) -> None:
    """Each rank stores its heads (objects named by head range); a TP 1 instance takes them out of both."""
    full, store = _caches(heads=2), MemoryStore()
    for r in (0, 1):
        own = tuple(cache[:, r : r + 1].clone() for cache in full)  # rank r's head of each layer
        _stored(_draft(own, heads=HeadRange(r, r + 1, 2)), store, list(range(6)))
    restoring = _draft(_caches(heads=2))
    job = RestoreJob(token_ids=TOKENS, keys=_keys(), layers=range(3), kv_dtype="float32")
    reached, _ = restoring.load(store, job, start=0, end=len(TOKENS), next_token=NEXT, block_ids=list(range(6)))
    assert reached == len(TOKENS)
    got, want = restoring.gather(list(range(6)), 0, len(TOKENS)), _draft(full).gather(list(range(6)), 0, len(TOKENS))
    assert torch.equal(got[:, :, rank], want[:, :, rank])


def test_the_ranks_rerun_a_draft_from_where_every_rank_loaded_its_stored_kv() -> None:
    class Rerun:
        def __init__(self) -> None:
            self.ran: list[tuple[int, int]] = []

        def rows(self, spec: LoadSpec, job: Any, kv: Any, store: Any, end: int, share: Any) -> tuple[torch.Tensor, int]:
            return torch.zeros(end - spec.start, 1), end

        def run(self, spec: LoadSpec, kv: Any, rows: torch.Tensor, end: int) -> None:
            self.ran.append((spec.start, end))

    rerun, events = Rerun(), []
    job = RestoreJob(token_ids=TOKENS, keys=_keys(), layers=range(3), kv_dtype="float32")
    restored = [Restored(LoadSpec("a", TOKENS, (), start=4), job, _KV, 24),  # type: ignore[arg-type]
                Restored(LoadSpec("b", TOKENS, (), start=0), job, _KV, 24)]  # type: ignore[arg-type]
    mine = {"a": (24, 100), "b": (16, 60)}  # this rank loaded all of "a", "b" up to its last chunk
    other_rank = iter([[16, 24], [24, 24]])  # the other rank loaded less of "a"; both reran to the end
    reached = restore_drafts(restored, lambda: rerun, MemoryStore(),  # type: ignore[arg-type, return-value]
                             agree=lambda values: [min(v, o) for v, o in zip(values, next(other_rank), strict=True)],
                             event=lambda kind, **fields: events.append((kind, fields)),
                             stored=lambda r: mine[r.spec.req_id])
    assert rerun.ran == [(16, 24), (16, 24)] and reached == [24, 24]
    assert [(f["req"], f["loaded"], f["tokens"], f["loaded_bytes"]) for kind, f in events if kind == "draft"] == [
        ("a", 12, 8, 100), ("b", 16, 8, 60)]
