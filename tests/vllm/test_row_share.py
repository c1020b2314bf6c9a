"""How a tensor-parallel instance's ranks share the rows stored beside its chunks (`ranks.RowShare`): an EAGLE
draft's inputs and a pipeline rank's boundary activations are the same on every rank (not split by head, unlike
KV), so each rank stores and reads those of every other chunk, and before a draft reruns the ranks add up what
they read, as bytes, over a real gloo group of two processes. The draft's forwards under vLLM's tensor
parallelism run in tests/bench/test_vllm_compat_smoke.py and test_eagle_restore.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cacheflow_common.kv.keys import chunk_keys, tenant_salt
from cacheflow_common.restore.boundary import OUTPUT_KIND, boundary_name, save_boundaries
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.store.memory import MemoryStore
from cacheflow_services.vllm_connector.draft import DraftPass, keep_draft_rows
from cacheflow_services.vllm_connector.plan import LoadSpec, SaveSpec
from cacheflow_services.vllm_connector.ranks import RowShare
from cacheflow_services.vllm_connector.saves import ConnectorSaves
from tests.vllm.test_draft_rows import CHUNK, HIDDEN, LAYERS, TOKENS, _job, _kv  # the same prefix and blocks

ROWS = torch.randn(len(TOKENS), HIDDEN, generator=torch.Generator().manual_seed(0))  # [N, hidden]
OUTPUT = [(LAYERS, OUTPUT_KIND)]  # an EAGLE draft's rows: the target's output


def _draft() -> DraftPass:
    runtime: Any = SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32,
                                   config=SimpleNamespace(hidden_size=HIDDEN))
    return DraftPass(runtime, drafter=None, sources=OUTPUT)


def _stored(job: RestoreJob, chunks: range) -> MemoryStore:
    store = MemoryStore()
    output = replace(job, layers=range(LAYERS, LAYERS + 1))
    save_boundaries(output, ROWS, store, model_fingerprint="fp", keys=job.keys[chunks.start : chunks.stop],
                    kind=OUTPUT_KIND)
    return store


def _byte_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """What `RowShare.gather` computes over the ranks' rows: their bytes added up."""
    total = sum(p.contiguous().view(torch.uint8).to(torch.int32) for p in parts)
    assert isinstance(total, torch.Tensor) and int(total.max()) <= 255  # each byte came from one rank
    return total.to(torch.uint8).view(parts[0].dtype)


def test_every_chunk_is_one_ranks() -> None:
    for ranks in (1, 2, 3, 8):
        shares = [RowShare(rank, ranks) for rank in range(ranks)]
        assert all(sum(share.mine(chunk) for share in shares) == 1 for chunk in range(50))
    assert RowShare().mine(7)  # without tensor parallelism the one rank holds every chunk


def test_each_rank_reads_its_chunks_rows_and_their_byte_sum_is_every_rows() -> None:
    job, kv = _job(), _kv()
    kv.keep(0, 2 * ROWS[:CHUNK])  # vLLM's model computed chunk 0 on every rank (the front)
    store = _stored(job, range(1, 4))
    spec = LoadSpec("r", TOKENS, tuple(range(4)), start=4)
    alone, end = _draft().rows(spec, job, kv, store, len(TOKENS))
    assert end == len(TOKENS)
    parts = []
    for rank in range(2):
        rows, reached = _draft().rows(spec, job, kv, store, len(TOKENS), RowShare(rank, 2))
        assert reached == len(TOKENS) and rows.shape == alone.shape
        parts.append(rows)
    assert torch.equal(_byte_sum(parts), alone)
    assert torch.equal(parts[0][CHUNK - 4 : 2 * CHUNK - 4], torch.zeros(CHUNK, HIDDEN))  # chunk 1 is rank 1's


def test_a_chunk_whose_rank_cannot_read_its_rows_stops_that_ranks_draft_there_only() -> None:
    job, kv = _job(), _kv()
    store = _stored(job, range(0, 2))  # chunks 2 and 3 have no rows: rank 0 misses chunk 2, rank 1 chunk 3
    spec = LoadSpec("r", TOKENS, tuple(range(4)), start=0)
    reached = [_draft().rows(spec, job, kv, store, len(TOKENS), RowShare(rank, 2))[1] for rank in range(2)]
    assert reached == [2 * CHUNK, 3 * CHUNK]  # the ranks agree on the least: 2 chunks, where the rows end


def test_a_rank_keeps_the_rows_of_its_own_chunks_as_they_load() -> None:
    job = _job()
    store = _stored(job, range(0, 4))
    kept, read = [], []
    for rank in range(2):
        kv = _kv()
        keep = keep_draft_rows(job, kv, store, OUTPUT, RowShare(rank, 2))
        for unit in range(4):
            keep(unit)
        kept.append([kv.outputs(c * CHUNK, (c + 1) * CHUNK) is not None for c in range(4)])
        read.append(kv.draft_bytes_read)
    assert kept == [[True, False, True, False], [False, True, False, True]]
    sizes = [len(store.read(boundary_name(key, LAYERS, OUTPUT_KIND)) or b"") for key in job.keys]
    assert read == [sizes[0] + sizes[2], sizes[1] + sizes[3]] and min(sizes) > 0  # each rank's own chunks' bytes


def test_each_rank_stores_the_rows_of_its_own_chunks_and_the_ranks_all_of_them() -> None:
    stores = []
    for rank in range(2):
        store, events = MemoryStore(), list[str]()
        saves = ConnectorSaves(store, lambda kind, _events=events, **fields: _events.append(kind), fingerprint="fp",
                               dtype=torch.float32, kv_dtype="float32", chunk_size=CHUNK, tenant="t",
                               row_share=RowShare(rank, 2))
        kv = torch.zeros(LAYERS, 2, 1, len(TOKENS) - CHUNK, 2)  # [L, 2, Hkv, T, D]: chunks 1-3
        saves.store_new(SaveSpec("r", TOKENS, tuple(range(4)), start=CHUNK), kv, ROWS[CHUNK:], range(LAYERS),
                        captured=OUTPUT)
        saves.close()
        assert events == ["save"]
        stores.append(store)
    keys = chunk_keys(TOKENS, CHUNK, tenant_salt("fp", "t"))
    held = [[s.exists(boundary_name(key, LAYERS, OUTPUT_KIND)) for key in keys] for s in stores]
    assert held == [[False, False, True, False], [False, True, False, True]]  # chunk 0 was stored before


def _gather_on_rank(rank: int, init: str, rows: dict[str, torch.Tensor], out: Path) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        share = RowShare(rank, 2)
        gathered = {}
        for name, full in rows.items():
            mine = full.clone()
            for chunk in range(len(full) // CHUNK):
                if not share.mine(chunk):
                    mine[chunk * CHUNK : (chunk + 1) * CHUNK] = 0
            gathered[name] = share.gather(mine, group=dist.group.WORLD)
        torch.save(gathered, out / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_ranks_rows_add_up_to_every_rows_bit_for_bit_over_a_real_process_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    special = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -3.5, 65504.0, 0.0])
    full = torch.cat([ROWS.flatten(), special]).repeat(4)[: 4 * CHUNK * HIDDEN].view(4 * CHUNK, HIDDEN)
    rows = {"float32": full, "bfloat16": full.to(torch.bfloat16), "float16": full.to(torch.float16)}
    init = f"file://{tmp_path / 'rendezvous'}"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the two processes meet on loopback
    mp.start_processes(_gather_on_rank, args=(init, rows, tmp_path), nprocs=2, start_method="spawn", join=True)
    for rank in range(2):
        gathered = torch.load(tmp_path / f"rank{rank}.pt")
        for name, expected in rows.items():
            got = gathered[name]
            assert got.dtype == expected.dtype
            assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name  # -0.0 and NaN too
