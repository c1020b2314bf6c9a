"""Restore the KV cache of one request's cached prefix on one stage, by any policy.

The step loop reads like the algorithm: the calling thread is the compute pointer, a loader thread is
the I/O pointer, and a `TwoPointerBoard` with a planner decides who takes which unit (token chunks in
token mode, layers in layer mode). The policies are the registry's (`cacheflow_common.sched.policies`):
its `planner` picks the board's planner — a fixed split at n (compute-only) or at 0 (load-only), greedy
two pointers (Cake), or the predictive meeting point (the CacheFlow policies); a stage worker restores a
batch of requests at once with the same policies in its engine instead (`cacheflow_services.worker`).

Misses (absent or corrupt chunks) are recomputed by every policy, load-only included. Load-only keeps
`LOAD_ONLY_READS_IN_FLIGHT` reads outstanding (one lands while the next crosses the link); the two-pointer
policies have one, the I/O pointer their planners model.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cacheflow_common.errors import BadRequestError, ConfigError
from cacheflow_common.kv.keys import ChunkKey
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.restore.board import Planner, TwoPointerBoard, UnitRecord
from cacheflow_common.restore.cores import move_off_compute_cores
from cacheflow_common.restore.costs import CostModel
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.restore.planner import FixedSplitPlanner, GreedyPlanner, PredictivePlanner
from cacheflow_common.sched.policies import POLICIES, Policy, make_policy
from cacheflow_common.sched.policies import choose_mode as policy_mode
from cacheflow_common.store.base import ChunkStore

log = logging.getLogger(__name__)

__all__ = ["POLICIES", "RestoreJob", "RestoreResult", "choose_mode", "restore", "run_restore"]

LOAD_ONLY_READS_IN_FLIGHT = 2

# The hidden states entering the stage's first layer for prefix tokens [start, end): [T, hidden].
StageInput = Callable[[int, int], torch.Tensor]
# Told of each chunk the compute pointer finished (token mode): its index and the hidden state
# leaving the stage for it, [T, hidden] (the next stage's input in a pipelined restore).
ChunkComputed = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True, kw_only=True)
class RestoreJob:
    """One request's cached prefix on one stage: what to restore, and how it was stored."""

    token_ids: tuple[int, ...]
    keys: tuple[ChunkKey, ...]  # one per chunk of token_ids (the last may be partial)
    layers: range  # the stage's layers [a_s, b_s)
    kv_dtype: str  # dtype the chunks were stored in, e.g. "bfloat16"
    quant: str = "none"  # "none" | "int8"

    def __post_init__(self) -> None:
        covered = self.keys[-1].token_end if self.keys else 0
        if covered != len(self.token_ids):
            raise BadRequestError(f"chunk keys cover {covered} tokens but the prefix has {len(self.token_ids)}")


@dataclass
class RestoreResult:
    """What a restore did: the filled KV buffer and, per unit, which side restored it and when."""

    policy: str
    mode: str  # "token" | "layer"
    kv: KVBuffer
    units: list[UnitRecord]
    elapsed_s: float
    loader_error: str = ""  # an unexpected loader failure (its units were recomputed)
    bytes_loaded: int = 0
    misses: Counter[str] = field(default_factory=Counter)

    def sources(self) -> list[str]:
        return [u.source for u in self.units]


def choose_mode(policy: str, n_tokens: int, l_delta: int) -> str:
    """Token-wise or layer-wise for `policy`; the adaptive ones pick token-wise when N >= L_delta."""
    return policy_mode(make_policy(policy), n_tokens, l_delta)


def restore(
    job: RestoreJob,
    *,
    model: Transformer,
    store: ChunkStore,
    policy: str,
    costs: CostModel | None = None,
    l_delta: int = 0,
    kv: KVBuffer | None = None,
    stage_input: StageInput | None = None,
    on_computed: ChunkComputed | None = None,
) -> RestoreResult:
    """Restore `job` into `kv` (allocated if None) with `policy`; returns what was done.

    `costs` (the profile's cost model behind the link in use) is required by the CacheFlow
    policies; `stage_input` defaults to the token embeddings (stage 0); `on_computed` as in `run_restore`.
    """
    mode = choose_mode(policy, len(job.token_ids), l_delta)
    kv = kv if kv is not None else _kv_for(model, job)
    loader = KVLoader(store=store, keys=job.keys, layers=job.layers, kv=kv, dtype=job.kv_dtype, quant=job.quant)
    if mode == "layer" and loader.absent_chunks():  # holes: token-wise recomputes only them
        mode = "token"
    chosen = make_policy(policy)
    planner = _planner(chosen, mode, job, loader, costs)
    reads = LOAD_ONLY_READS_IN_FLIGHT if chosen.planner == "load" else 1
    return run_restore(job, model=model, loader=loader, mode=mode, planner=planner, policy=policy,
                       stage_input=stage_input, on_computed=on_computed, reads_in_flight=reads)


def run_restore(
    job: RestoreJob,
    *,
    model: Transformer,
    loader: KVLoader,
    mode: str,
    planner: Planner,
    policy: str = "custom",
    stage_input: StageInput | None = None,
    on_computed: ChunkComputed | None = None,
    on_board: Callable[[TwoPointerBoard], None] | None = None,
    reads_in_flight: int = 1,
) -> RestoreResult:
    """The restore loop: this thread is the compute pointer, `reads_in_flight` loader threads the I/O pointer.

    `on_computed` (token mode only) hears of every computed chunk; `on_board` gets the board before
    the pointers start (to wake it when an outside input a planner waits for arrives).
    """
    kv = loader.kv
    if on_computed is not None and mode != "token":
        raise ConfigError("only a token-wise restore can report its computed chunks")
    if not job.token_ids:
        return RestoreResult(policy=policy, mode=mode, kv=kv, units=[], elapsed_s=0.0)
    inputs = stage_input or _embedding_input(model, job.token_ids)
    n_units = len(job.keys) if mode == "token" else len(job.layers)
    board = TwoPointerBoard(n_units, planner=planner, compute_skips_loaded=mode == "token")
    if on_board is not None:
        on_board(board)
    loader_error: list[str] = []
    readers = _Readers(reads_in_flight)
    threads = [threading.Thread(target=_run_loader, args=(board, _unit_loader(loader, job, mode, reads_in_flight > 1),
                                                          readers, loader_error), daemon=True)
               for _ in range(reads_in_flight)]

    start = time.perf_counter()
    for thread in threads:
        thread.start()
    if mode == "token":
        _compute_chunks(board, model, job, kv, inputs, on_computed)
    else:
        _compute_layers(board, model, job, kv, inputs)
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    misses = Counter(u.miss_reason for u in board.records if u.miss_reason)
    return RestoreResult(policy=policy, mode=mode, kv=kv, units=board.records, elapsed_s=elapsed,
                         loader_error=loader_error[0] if loader_error else "",
                         bytes_loaded=loader.bytes_read, misses=misses)


def _kv_for(model: Transformer, job: RestoreJob) -> KVBuffer:
    return model.new_kv(job.layers, max(1, len(job.token_ids)))


def _embedding_input(model: Transformer, token_ids: Sequence[int]) -> StageInput:
    ids = torch.tensor(token_ids, dtype=torch.long)  # [N]

    def inputs(start: int, end: int) -> torch.Tensor:
        return model.embed(ids[start:end])  # [T, hidden]

    return inputs


def _compute_chunks(board: TwoPointerBoard, model: Transformer, job: RestoreJob, kv: KVBuffer,
                    inputs: StageInput, on_computed: ChunkComputed | None) -> None:
    """The compute pointer, token mode: run the stage's layers over each claimed chunk."""
    while (unit := board.claim_compute()) is not None:
        key = job.keys[unit]
        hidden = inputs(key.token_start, key.token_end)  # [T, hidden]
        out = model.forward_layers(hidden, job.layers, [Span(kv, key.token_start, key.token_end - key.token_start)])
        board.compute_done(unit)
        if on_computed is not None:
            on_computed(unit, out)  # [T, hidden]


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
    staging = memoryview(bytearray(loader.staging_bytes)) if own_staging else None
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


def _planner(policy: Policy, mode: str, job: RestoreJob, loader: KVLoader, costs: CostModel | None) -> Planner:
    n_units = len(job.keys) if mode == "token" else len(job.layers)
    if policy.planner == "compute":
        return FixedSplitPlanner(n_units)
    if policy.planner == "load":
        return FixedSplitPlanner(0)
    if policy.planner == "greedy":
        return GreedyPlanner()
    if costs is None:
        raise ConfigError(f"policy {policy.name!r} needs a cost model: run `cacheflow profile` and pass its costs")
    n_layers = len(job.layers)
    if mode == "token":
        compute = [costs.chunk_compute_s(k.token_start, k.token_end, n_layers) for k in job.keys]
        load = [costs.chunk_load_s(loader.chunk_bytes(i)) for i in range(len(job.keys))]
    else:
        n = len(job.token_ids)
        compute = [costs.layer_compute_s(n)] * n_layers
        load = [costs.layer_load_s(loader.layer_bytes(), len(job.keys))] * n_layers
    return PredictivePlanner(compute, load)
