"""The benchmarks' baseline runner: one request's restore with a FIXED split, units below it computed and the
rest loaded (`split = n` is compute-only, `0` load-only), on a `TwoPointerBoard`.

Every policy (CacheFlow, Cake, compute-only, load-only) runs in the engine (`cacheflow_common.engine`);
this runner exists only because the single-request benchmark measures its baselines at their strongest
and the bound's unit costs with it: compute-only in any chunking (the whole prefix as one prefill
included) and load-only with `LOAD_ONLY_READS_IN_FLIGHT` reads outstanding, one landing while the next
crosses the link. Misses (absent or corrupt chunks) are recomputed here too.

The calling thread is the compute side, `reads_in_flight` loader threads the I/O side.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.restore.board import TwoPointerBoard
from cacheflow_common.restore.cores import move_off_compute_cores
from cacheflow_common.restore.job import RestoreJob, RestoreResult
from cacheflow_common.restore.loader import KVLoader, staging_buffer
from cacheflow_common.restore.stage_input import EmbeddingInput, StageInput

log = logging.getLogger(__name__)

__all__ = ["LOAD_ONLY_READS_IN_FLIGHT", "run_fixed_split"]

LOAD_ONLY_READS_IN_FLIGHT = 2

def run_fixed_split(job: RestoreJob, *, model: Transformer, loader: KVLoader, mode: str, split: int,
                    reads_in_flight: int = 1, label: str = "") -> RestoreResult:
    """Restore `job` into `loader.kv`: units `< split` computed (by this thread), the rest loaded by
    `reads_in_flight` loader threads; token mode's units are the job's chunks, layer mode's its layers."""
    kv = loader.kv
    label = label or f"{mode}-split-{split}"
    if not job.token_ids:
        return RestoreResult(policy=label, mode=mode, kv=kv, units=[], elapsed_s=0.0)
    inputs = EmbeddingInput(model, job.token_ids)
    n_units = len(job.keys) if mode == "token" else len(job.layers)
    board = TwoPointerBoard(n_units, split=split, compute_skips_loaded=mode == "token")
    loader_error: list[str] = []
    readers = _Readers(reads_in_flight)
    threads = [threading.Thread(target=_run_loader, args=(board, _unit_loader(loader, job, mode, reads_in_flight > 1),
                                                          readers, loader_error), daemon=True)
               for _ in range(reads_in_flight)]

    start = time.perf_counter()
    for thread in threads:
        thread.start()
    if mode == "token":
        _compute_chunks(board, model, job, kv, inputs)
    else:
        _compute_layers(board, model, job, kv, inputs)
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    return RestoreResult(policy=label, mode=mode, kv=kv, units=board.records(), elapsed_s=elapsed,
                         loader_error=loader_error[0] if loader_error else "",
                         bytes_loaded=loader.bytes_read, misses=board.log.misses())


def _compute_chunks(board: TwoPointerBoard, model: Transformer, job: RestoreJob, kv: KVBuffer,
                    inputs: StageInput) -> None:
    """The compute pointer, token mode: run the stage's layers over each claimed chunk."""
    while (unit := board.claim_compute()) is not None:
        key = job.keys[unit]
        hidden = inputs(key.token_start, key.token_end)  # [T, hidden]
        model.forward_layers(hidden, job.layers, [Span(kv, key.token_start, key.token_end - key.token_start)])
        board.compute_done(unit)


def _compute_layers(board: TwoPointerBoard, model: Transformer, job: RestoreJob, kv: KVBuffer,
                    inputs: StageInput) -> None:
    """The compute pointer, layer mode: run each claimed layer over the whole prefix."""
    n = len(job.token_ids)
    hidden: torch.Tensor | None = None  # [N, hidden] entering the next layer to compute
    while (unit := board.claim_compute()) is not None:
        if hidden is None:
            hidden = inputs(0, n)
        layer = job.layers.start + unit
        hidden = model.forward_layers(hidden, range(layer, layer + 1), [Span(kv, 0, n)])
        board.compute_done(unit)


def _unit_loader(loader: KVLoader, job: RestoreJob, mode: str, own_staging: bool) -> Callable[[int], str]:
    """Loads one unit (a chunk, or a layer of every chunk); with `own_staging`, through a buffer of its own
    (for one of several reading threads), else through the loader's."""
    staging = staging_buffer(loader.staging_bytes) if own_staging else None
    if mode == "token":
        return lambda u: loader.load_chunk(u, staging)
    return lambda u: loader.load_layer(job.layers.start + u, staging)


class _Readers:
    """A restore's reading threads: the loader side retires when the last of them stops on an error."""

    def __init__(self, n: int) -> None:
        self._live = n
        self._lock = threading.Lock()

    def failed(self) -> bool:
        """One reader stopped on an error; True if it was the last one."""
        with self._lock:
            self._live -= 1
            return self._live == 0


def _run_loader(board: TwoPointerBoard, load_unit: Callable[[int], str], readers: _Readers,
                error: list[str]) -> None:
    """One reader of the I/O pointer: load units from the back until the planner stops it or the pointers meet.

    A failure (not a miss: the store itself failing) hands the unit it was reading back to compute and
    stops this reader; when it was the last one, whatever is left is recomputed."""
    move_off_compute_cores()
    while (unit := board.claim_load()) is not None:
        try:
            reason = load_unit(unit)
        except Exception as exc:  # its unit, and once no reader is left every other unit, are recomputed
            log.exception("loader failed; its chunks will be recomputed")
            error.append(f"{type(exc).__name__}: {exc}")
            board.load_missed(unit, "loader-error")
            if readers.failed():
                board.abort_loader("loader-error")
            return
        if reason:
            board.load_missed(unit, reason)
        else:
            board.load_done(unit)
