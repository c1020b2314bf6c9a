"""The single-request bench's measurements: baseline runs at their strongest, unit costs for the bound,
and the checks every run's KV must pass.

* compute-only: the runtime's fastest recompute of the prefix, chosen per length from a few chunkings
  (the restore's chunk, 1,024 tokens, the whole prefix in one prefill), measured.
* load-only: the fixed-split runner's (`restore.executor`), every unit read with
  `LOAD_ONLY_READS_IN_FLIGHT` reads outstanding, so the link never waits for the landing of the previous
  read; the better of token and layer order.
* the bound T*: from the unit costs of one repeat's compute-only (restore chunk) and load-only runs,
  the best split in token or layer order, or the fastest compute-only run if that is faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.costs import best_split
from cacheflow_common.restore.executor import LOAD_ONLY_READS_IN_FLIGHT, run_fixed_split
from cacheflow_common.restore.job import RestoreJob, RestoreResult
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.restore.save import make_job
from cacheflow_common.store.base import ChunkStore

COMPUTE_CHUNKINGS = (1024,)  # tried besides the restore's chunk and the whole prefix


@dataclass(frozen=True)
class LoadRun:
    """A load-only run: its wall time, each unit's share of it (time between completions) and the KV."""

    mode: str
    elapsed_s: float
    unit_costs: list[float]
    kv: torch.Tensor  # [L, 2, Hkv, N, D]
    bytes_loaded: int


def forced(model: Transformer, job: RestoreJob, store: ChunkStore, mode: str, split: int,
           reads_in_flight: int = 1) -> RestoreResult:
    """A run with a fixed split: `split = n_units` is compute-only, `0` load-only."""
    loader = KVLoader(store=store, keys=job.keys, layers=job.layers, kv=model.new_kv(job.layers, len(job.token_ids)),
                      dtype=job.kv_dtype, quant=job.quant)
    result = run_fixed_split(job, model=model, loader=loader, mode=mode, split=split, reads_in_flight=reads_in_flight)
    require_complete(result)
    return result


def compute_only(model: Transformer, job: RestoreJob, chunk: int) -> RestoreResult:
    """The prefix recomputed in chunks of `chunk` tokens (the whole prefix: one prefill pass)."""
    rechunked = make_job(model, job.token_ids, tenant="bench-compute", chunk_size=chunk)
    return forced(model, rechunked, _NO_STORE, "token", len(rechunked.keys))


def fastest_chunking(model: Transformer, job: RestoreJob, restore_chunk: int) -> tuple[int, dict[int, float]]:
    """The chunk size whose compute-only run is fastest (after a warm-up of each), and every one's time."""
    n = len(job.token_ids)
    candidates = sorted({restore_chunk, n, *(c for c in COMPUTE_CHUNKINGS if restore_chunk < c < n)})
    for chunk in candidates:
        compute_only(model, job, chunk)  # warm-up: a new shape's first run is slower
    times = {chunk: compute_only(model, job, chunk).elapsed_s for chunk in candidates}
    return min(times, key=lambda c: times[c]), times


def pipelined_load(model: Transformer, job: RestoreJob, store: ChunkStore, mode: str) -> LoadRun:
    """Load-only as the fixed-split runner runs it (`LOAD_ONLY_READS_IN_FLIGHT` reads outstanding); each unit's cost is
    the time from the previous unit's completion to its own, so the costs add up to the run."""
    result = forced(model, job, store, mode, 0, reads_in_flight=LOAD_ONLY_READS_IN_FLIGHT)
    if any(source != "loaded" for source in result.sources()):
        raise RuntimeError(f"load-only computed units {result.sources()}")
    done = sorted(u.end_s for u in result.units)
    costs = [b - a for a, b in zip([0.0, *done[:-1]], done, strict=True)]
    return LoadRun(mode, result.elapsed_s, costs, result.kv.data[:, :, :, : len(job.token_ids)], result.bytes_loaded)


class _NoStore:
    """Compute-only reads nothing; a read would be a bug."""

    def read_into(self, name: str, buf: memoryview, offset: int) -> bool:
        raise AssertionError(f"compute-only read {name}")

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int) -> bool:
        raise AssertionError(f"compute-only read {name}")

    def exists(self, name: str) -> bool:
        return False


_NO_STORE: ChunkStore = _NoStore()  # type: ignore[assignment]


def require_complete(result: RestoreResult) -> None:
    if result.misses or result.loader_error:
        raise RuntimeError(f"benchmark restore had misses {dict(result.misses)} {result.loader_error}")


def unit_costs(result: RestoreResult) -> list[float]:
    return [u.end_s - u.start_s for u in result.units]


def split_bound(compute_costs: Sequence[float], load_costs: Sequence[float]) -> float:
    """The best split's time: compute units [0, k), load units [k, n), both sides at once."""
    return best_split(list(compute_costs), list(load_costs))[1]


def kv_errors(result_kv: torch.Tensor, reference: torch.Tensor, sources: Sequence[str], mode: str,
              job: RestoreJob) -> dict[str, float]:
    """Largest |restored - full prefill| over the loaded units and over the computed ones, relative to the
    full prefill's largest |value|. Loaded units must match exactly; computed ones to the dtype's rounding.

    result_kv, reference: [L, 2, Hkv, N, D] (the job's layers)."""
    scale = reference.float().abs().max().item() or 1.0
    errors = {"loaded": 0.0, "computed": 0.0}
    for unit, source in enumerate(sources):
        if mode == "token":
            span = slice(job.keys[unit].token_start, job.keys[unit].token_end)
            got, want = result_kv[:, :, :, span], reference[:, :, :, span]
        else:
            got, want = result_kv[unit], reference[unit]
        errors[source] = max(errors[source], (got.float() - want.float()).abs().max().item() / scale)
    return errors
