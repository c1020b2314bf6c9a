"""Restores whose meeting point is planned before they start: on tensor-parallel ranks, and by loads alone.

Recomputing with vLLM's model on a tensor-parallel rank runs its collectives, so every rank must run the
same forwards, of the same sizes, in the same order. The two-pointer restore decides how far compute goes
as loads land, differently on each rank, and a rank that computed one unit more would wait forever on the
others. So a tensor-parallel rank plans its meeting point up front from what every rank knows alike (the
prefix's chunks, the profile's costs, the policy): the split that ends first by the bound's formula
(`best_split`). It recomputes the chunks before it with vLLM's model, in forwards of at most
`prefill_tokens`, while a thread loads the chunks from it on (its own slice of the KV heads, keyed by its
rank). A chunk that misses ends the restore there: vLLM recomputes from its first block on, on every rank
together (vLLM takes the union of the ranks' failed blocks), so the forwards never depend on a load.

Without a profile there is no cost to plan with, and where nothing may recompute beside vLLM (LoRA:
`connector.py` says why) the front is empty: every chunk is loaded, front to back, up to the first miss.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from cacheflow_common.model.transformer import Span
from cacheflow_common.restore.costs import CostModel, best_split
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.sched.plan import chunk_costs
from cacheflow_common.sched.policies import Policy
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.vllm_runtime import VllmRuntime


class Split(NamedTuple):
    end: int  # tokens [0, end) are in the blocks
    computed: int  # chunks recomputed
    loaded: int  # chunks loaded
    bytes_read: int
    miss: str  # why the chunk at `end` missed, or "" (all restored)


def planned_front(job: RestoreJob, *, start: int, costs: CostModel | None, policy: Policy, kv_bytes: int) -> int:
    """The position the loads start from: chunks before it are recomputed, the others loaded (a policy that
    fixes the split fixes it here too). `start`: the first position vLLM does not hold; `kv_bytes`: one
    token's KV in one layer, as stored."""
    units = [key for key in job.keys if key.token_end > start]
    if not units or costs is None or not policy.computes_pending:
        return start
    if not policy.loads:
        return units[-1].token_end
    n_layers = len(job.layers)
    compute_s = [chunk_costs(costs, max(key.token_start, start), key.token_end, n_layers)[0] for key in units]
    load_s = [costs.chunk_load_s(key.n_tokens * n_layers * kv_bytes) for key in units]
    k, _ = best_split(compute_s, load_s)
    return units[k - 1].token_end if k else start


def restore_split(job: RestoreJob, store: ChunkStore, kv: BlockKV, model: VllmRuntime | None, *, start: int,
                  front: int, prefill_tokens: int) -> Split:
    """Recompute positions [start, front) with vLLM's `model` while a thread loads the job's chunks from
    `front` on, in order, until one misses (each written into the blocks as it lands)."""
    loader = KVLoader(store=store, keys=job.keys, layers=job.layers, kv=kv, dtype=job.kv_dtype, quant=job.quant)
    back = [unit for unit, key in enumerate(job.keys) if key.token_end > max(start, front)]
    loaded: list[str] = []  # the back's miss reasons, in order, up to the first miss
    thread = threading.Thread(target=_load, args=(loader, back, loaded), name="cacheflow-tp-loads", daemon=True)
    thread.start()
    try:
        computed = _recompute(job, kv, model, start, front, prefill_tokens) if front > start else 0
    finally:
        thread.join()
    hits = loaded[:-1] if loaded and loaded[-1] else loaded
    end = job.keys[back[len(hits) - 1]].token_end if hits else max(start, front)
    return Split(end, computed, len(hits), loader.bytes_read, loaded[-1] if loaded else "")


def _load(loader: KVLoader, units: list[int], reasons: list[str]) -> None:
    for unit in units:
        reasons.append(loader.load_chunk(unit))
        if reasons[-1]:
            return


def _recompute(job: RestoreJob, kv: BlockKV, model: VllmRuntime | None, start: int, front: int,
               prefill_tokens: int) -> int:
    """vLLM's model over positions [start, front), in forwards of at most `prefill_tokens` (each attends over
    the ones before it in the blocks); returns the chunks recomputed."""
    if model is None:
        raise RuntimeError("a planned front needs vLLM's model")
    ids = torch.tensor(job.token_ids, dtype=torch.long)  # [N]
    for a in range(start, front, prefill_tokens):
        b = min(a + prefill_tokens, front)
        model.forward_layers(model.embed(ids[a:b]), job.layers, [Span(kv, a, b - a)])  # KV of [a, b) in the blocks
    return sum(1 for key in job.keys if start < key.token_end <= front)
