"""What an EAGLE draft's rerun starts from (`draft.py`): the target's output rows per restored position — those
vLLM's model returned for the recomputed front, those stored with each loaded chunk — up to the first chunk with
neither; the tokens a rerun feeds the draft (EAGLE's shifted by one, a draft model's not); and how far each
restore's draft goes when the tensor-parallel ranks agree. The draft's forwards with vLLM's model need vLLM:
tests/bench/test_eagle_restore.py and test_draft_model_restore.py run them (here a recording stand-in)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cacheflow_common.kv.keys import chunk_keys, tenant_salt
from cacheflow_common.model.transformer import Span
from cacheflow_common.restore.boundary import BOUNDARY_KIND, OUTPUT_KIND, boundary_name, save_boundaries
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.store.memory import MemoryStore
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.draft import DraftPass, Restored, restore_drafts
from cacheflow_services.vllm_connector.plan import LoadSpec

CHUNK, LAYERS, HIDDEN = 8, 2, 4
TOKENS = tuple(range(100, 100 + 4 * CHUNK))
ROWS = torch.arange(len(TOKENS) * HIDDEN, dtype=torch.float32).view(len(TOKENS), HIDDEN)  # [N, hidden]


def _job() -> RestoreJob:
    keys = tuple(chunk_keys(TOKENS, CHUNK, tenant_salt("fp", "t")))
    return RestoreJob(token_ids=TOKENS, keys=keys, layers=range(LAYERS), kv_dtype="float32")


def _kv() -> BlockKV:
    caches = {layer: torch.zeros(8, 1, CHUNK, 4) for layer in range(LAYERS)}  # [blocks, Hkv, block, 2D]
    kv = BlockKV(layers=range(LAYERS), num_kv_heads=1, head_dim=2, capacity=len(TOKENS), dtype=torch.float32,
                 caches=caches, layout="split", block_ids=range(4), block_size=CHUNK, first_writable=0)
    kv.keep_outputs()
    return kv


def _draft(sources: list[tuple[int, str]]) -> DraftPass:
    runtime: Any = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    return DraftPass(runtime, drafter=None, sources=sources)


def test_rows_come_from_the_recomputed_front_then_the_stored_chunks_up_to_the_first_without() -> None:
    job, store, kv = _job(), MemoryStore(), _kv()
    kv.keep(0, 2 * ROWS[: CHUNK + 3])  # vLLM's model computed chunk 0 and part of chunk 1 (a cut forward)
    kv.keep(CHUNK + 3, 2 * ROWS[CHUNK + 3 : 2 * CHUNK])
    output = replace(job, layers=range(LAYERS, LAYERS + 1))
    save_boundaries(output, ROWS, store, model_fingerprint="fp", keys=job.keys[1:3], kind=OUTPUT_KIND)  # chunks 1, 2
    spec = LoadSpec("r", TOKENS, tuple(range(4)), start=4)
    rows, reached = _draft([(LAYERS, OUTPUT_KIND)]).rows(spec, job, kv, store, len(TOKENS))
    assert reached == 3 * CHUNK  # chunk 3 has neither
    assert torch.equal(rows, torch.cat([2 * ROWS[4 : 2 * CHUNK], ROWS[2 * CHUNK : 3 * CHUNK]]))
    stored = store.read(boundary_name(job.keys[2], LAYERS, OUTPUT_KIND))  # the one chunk's rows read from storage
    assert stored is not None and kv.draft_bytes_read == len(stored)


def test_an_eagle3_draft_reads_the_boundary_activations_of_its_auxiliary_layers_side_by_side() -> None:
    job, store, kv = _job(), MemoryStore(), _kv()
    for layer in (0, 2):
        at = replace(job, layers=range(layer, layer + 1))
        save_boundaries(at, ROWS + 1000 * layer, store, model_fingerprint="fp", keys=job.keys[:2])  # chunks 0, 1
    spec = LoadSpec("r", TOKENS, tuple(range(4)), start=0)
    rows, reached = _draft([(0, BOUNDARY_KIND), (2, BOUNDARY_KIND)]).rows(spec, job, kv, store, len(TOKENS))
    assert reached == 2 * CHUNK
    assert torch.equal(rows, torch.cat([ROWS[: 2 * CHUNK], ROWS[: 2 * CHUNK] + 2000], dim=-1))  # [16, 2 hidden]


class _Recorder:
    """Stands in for vLLM's runtime (its forward contexts, forwards of at most `max_rows` rows) and draft model
    (records each forward's inputs)."""

    device, dtype, max_rows = torch.device("cpu"), torch.float32, 10

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    @contextmanager
    def forward_context(self, spans: Sequence[Span]) -> Iterator[torch.Tensor]:
        yield torch.cat([torch.arange(s.start, s.start + s.length) for s in spans])  # [r]

    def __call__(self, **inputs: Any) -> None:
        self.calls.append(inputs)


@pytest.mark.parametrize(("sources", "first_token"), [([(LAYERS, OUTPUT_KIND)], 5), ([], 4)])
def test_a_rerun_feeds_an_eagle_draft_the_next_tokens_and_its_rows_and_a_draft_model_the_tokens(
        sources: list[tuple[int, str]], first_token: int) -> None:
    """Positions [4, 32) in forwards of at most 10 rows: at position i an EAGLE draft reads token i + 1 (the
    prompt's next after the prefix) and row i; a draft model reads token i alone."""
    recorder = _Recorder()
    spec = LoadSpec("r", TOKENS, tuple(range(4)), start=4, next_token=7)
    DraftPass(recorder, recorder, sources=sources).run(spec, _kv(), ROWS[4:], len(TOKENS))  # type: ignore[arg-type]
    ids = torch.cat([call["input_ids"] for call in recorder.calls])
    expected = [*TOKENS[first_token:], 7][: len(TOKENS) - 4]  # [28]
    assert ids.tolist() == expected and [len(call["input_ids"]) for call in recorder.calls] == [10, 10, 8]
    assert torch.cat([call["positions"] for call in recorder.calls]).tolist() == list(range(4, len(TOKENS)))
    if sources:
        assert torch.equal(torch.cat([call["hidden_states"] for call in recorder.calls]), ROWS[4:])
    else:
        assert all("hidden_states" not in call for call in recorder.calls)


def test_a_draft_model_reads_no_rows_so_every_chunk_serves_it() -> None:
    rows, reached = _draft([]).rows(LoadSpec("r", TOKENS, tuple(range(4)), start=4), _job(), _kv(), MemoryStore(), 24)
    assert rows.numel() == 0 and reached == 24


class _Stub:
    """Stands in for a `DraftPass` where only the agreement is tested: rows found up to `reach`, runs recorded."""

    def __init__(self, reach: dict[str, int], fails: set[str]) -> None:
        self.reach, self.fails = reach, fails
        self.ran: list[tuple[str, int, int]] = []

    def rows(self, spec: LoadSpec, job: Any, kv: Any, store: Any, end: int, share: Any) -> tuple[torch.Tensor, int]:
        if spec.req_id in self.fails:
            raise RuntimeError("no draft model")
        return ROWS[spec.start : self.reach[spec.req_id]], self.reach[spec.req_id]

    def run(self, spec: LoadSpec, kv: Any, rows: torch.Tensor, end: int) -> None:
        self.ran.append((spec.req_id, end, len(rows)))


def test_the_ranks_rerun_each_draft_as_far_as_every_rank_reached_and_log_each() -> None:
    stub = _Stub({"a": 32, "b": 24, "c": 32}, fails={"c"})
    events: list[tuple[str, dict[str, Any]]] = []
    restored = [Restored(LoadSpec(name, TOKENS, (), start=8), _job(), _kv(), 32) for name in "abc"]
    restored.append(Restored(LoadSpec("d", TOKENS, (), start=8), None, None, 8))  # a restore that failed
    other_rank = [16, 24, 32, 8]  # what the other rank reached, per restore
    for n_bytes in (100, 23):  # "b"'s rows read from storage: kept with a chunk loaded, then by its rerun
        restored[1].kv.read_draft_rows(n_bytes)  # type: ignore[union-attr]
    reached = restore_drafts(restored, lambda: stub, MemoryStore(),  # type: ignore[arg-type, return-value]
                             agree=lambda mine: [min(a, b) for a, b in zip(mine, other_rank, strict=True)],
                             event=lambda kind, **fields: events.append((kind, fields)))
    assert reached == [16, 24, 8, 8]
    assert stub.ran == [("a", 16, 8), ("b", 24, 16)]  # "c" could not find its rows: not run on any rank
    assert [(f["req"], f["tokens"], f["short"], f["bytes_read"]) for kind, f in events if kind == "draft"] == [
        ("a", 8, 16, 0), ("b", 16, 8, 123), ("c", 0, 24, 0), ("d", 0, 0, 0)]
    assert [f["req"] for kind, f in events if kind == "draft_error"] == ["c"]


def test_rows_a_late_load_brings_after_the_seal_are_not_kept() -> None:
    kv = _kv()
    kv.keep(0, ROWS[:CHUNK])
    kv.seal()  # what the restore wrote is fixed: a load still in flight lands nothing, its rows neither
    kv.keep(CHUNK, ROWS[CHUNK : 2 * CHUNK])
    kept = kv.outputs(0, CHUNK)
    assert kept is not None and torch.equal(kept, ROWS[:CHUNK]) and kv.outputs(CHUNK, 2 * CHUNK) is None
