"""One request's restore on this stage, as the engine carries it out: where its units' inputs come
from, how one unit is computed or loaded, what happened to each unit, and the summary it answers with.

The decisions (which unit computes next, which a channel loads) are the batch scheduler's; this object
only does the work a decision names and records it. Units are token chunks (token mode; compute-only
recomputes in the engine's prefill size instead of the storage chunk size) or layers (layer mode).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.restore.job import ChunkComputed, RestoreJob, UnitLog, UnitRecord
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.restore.pointers import Unit
from cacheflow_common.restore.stage_input import StageInput
from cacheflow_common.restore.upstream import UpstreamInput
from cacheflow_common.sched.plan import RequestPlan
from cacheflow_common.sched.policies import Policy
from cacheflow_common.stage_api import RestoreSummary


@dataclass(frozen=True, kw_only=True)
class RestoreSpec:
    """What the engine was asked to restore, and how."""

    request_id: str
    job: RestoreJob
    policy: Policy
    mode: str  # "token" | "layer"
    input_mode: str  # "boundary" | "pipelined" | "sequential" (stage 0: its embeddings in every case)
    fallback: str = ""  # why the policy differs from the one asked for ("" when it does not)
    profiled: bool = False  # the plan's times come from a profile (else they only order units)


class StageRestore:
    def __init__(self, spec: RestoreSpec, *, plan: RequestPlan, kv: KVBuffer, loader: KVLoader,
                 inputs: StageInput, unit_tokens: list[tuple[int, int]],
                 on_computed: ChunkComputed | None = None, on_loaded: Callable[[int], None] | None = None,
                 closers: tuple[Callable[[], None], ...] = ()) -> None:
        self.spec = spec
        self.plan = plan
        self.kv = kv
        self.loader = loader
        self.inputs = inputs
        self.unit_tokens = unit_tokens  # token mode: each unit's token range; layer mode: (0, N) per layer
        self.on_computed = on_computed
        self.on_loaded = on_loaded  # after each token-wise unit (a chunk) loaded, on its channel's thread
        self.done: Future[RestoreSummary] = Future()
        # Each unit's two-pointer state, kept by the batch scheduler (a live view it hands out on arrival);
        # this object logs only when units ran and why loads missed.
        self.states: Sequence[Unit] = ()
        self._log = UnitLog(len(unit_tokens))  # its clock starts with the restore
        self.looks_at_admit: tuple[int, ...] = ()  # each channel's looks when it arrived (EngineCore)
        self.seen_by_channels = False  # every channel has looked since: compute may start
        self.error: BaseException | None = None  # why the engine stopped it (its waiter gets this)
        self._closers = closers
        self._hidden: torch.Tensor | None = None  # layer mode: [N, hidden] entering the next layer to compute
        self._lock = threading.Lock()  # the log, written by the loop and the channels

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def n_tokens(self) -> int:
        return len(self.spec.job.token_ids)

    # -- compute (the engine's loop) -----------------------------------------------------------
    def ready(self, unit: int) -> bool:
        """Whether compute may take `unit` now without waiting for its input.

        Fed by the previous stage, a chunk it did not deliver is left to the loader; only once its load
        missed (or it was never stored) does compute try it, and fail the restore clearly if the previous
        stage has finished without it.
        """
        start, end = self.unit_tokens[unit]
        if self.spec.mode == "layer" and self._hidden is not None:
            return True
        if isinstance(self.inputs, UpstreamInput) and self.states[unit] is not Unit.MISSED:
            return self.inputs.delivered(unit)
        return self.inputs.ready(start, end)

    def token_span(self, unit: int) -> tuple[torch.Tensor, Span]:
        """Token mode: the unit's input rows [T, hidden] and where its KV goes."""
        start, end = self.unit_tokens[unit]
        return self.inputs(start, end), Span(self.kv, start, end - start)

    def compute_layer(self, model: Transformer, unit: int) -> None:
        """Layer mode: run layer `unit` of the stage over the whole prefix (writes its KV)."""
        if self._hidden is None:
            self._hidden = self.inputs(0, self.n_tokens)  # [N, hidden]
        layer = self.spec.job.layers.start + unit
        self._hidden = model.forward_layers(self._hidden, range(layer, layer + 1), [Span(self.kv, 0, self.n_tokens)])

    def computed(self, unit: int, out: torch.Tensor | None, started: float, ended: float) -> None:
        """The loop computed `unit`; `out` [T, hidden] is what leaves the stage for it (token mode)."""
        self._ran(unit, started, ended)
        if self.on_computed is not None and out is not None:
            self.on_computed(unit, out)

    # -- loads (a channel's thread) -------------------------------------------------------------
    def load(self, unit: int, staging: memoryview) -> str:
        """Load `unit` (bytes only, no torch ops but `on_loaded`'s); "" or the reason it missed."""
        if self.spec.mode == "token":
            miss = self.loader.load_chunk(unit, staging)
            if not miss and self.on_loaded is not None:
                self.on_loaded(unit)
            return miss
        return self.loader.load_layer(self.spec.job.layers.start + unit, staging)

    def loaded(self, unit: int, started: float, ended: float, miss: str) -> None:
        if miss:
            with self._lock:
                self._log.missed(unit, miss)
        else:
            self._ran(unit, started, ended)

    # -- the end ----------------------------------------------------------------------------------
    def records(self) -> list[UnitRecord]:
        """Each unit: which side restored it, when, and why its load missed."""
        with self._lock:
            return self._log.records(self.states)

    def summary(self, stage: int) -> RestoreSummary:
        sources = [r.source for r in self.records()]
        with self._lock:
            misses = self._log.misses()
        return RestoreSummary.model_validate({
            "request_id": self.request_id, "stage": stage, "input": self.spec.input_mode,
            "policy": self.spec.policy.name, "fallback": self.spec.fallback, "mode": self.spec.mode,
            "elapsed_s": time.perf_counter() - self._log.t0,
            "computed": sources.count("computed"), "loaded": sources.count("loaded"), "misses": dict(misses),
            "bytes_loaded": self.loader.bytes_read, "boundary_bytes_read": int(getattr(self.inputs, "bytes_read", 0)),
            "bytes_unused": max(0, self.loader.bytes_read - self._bytes_used(sources)),
            "predicted_recompute_s": sum(self.plan.stages[0].compute_s) if self.spec.profiled else 0.0})

    def _bytes_used(self, sources: list[str]) -> int:
        """Bytes of the units loaded: a chunk's sections (token mode), or one layer's of every chunk."""
        layouts = self.loader.layouts
        if self.spec.mode == "token":
            return sum(layouts[u].sections_size for u, source in enumerate(sources) if source == "loaded")
        return sources.count("loaded") * sum(layout.section_size for layout in layouts)

    def missed_units(self) -> list[int]:
        with self._lock:
            return self._log.missed_units()

    def close(self) -> None:
        """Stop background reads of its inputs; the hidden state of layer mode is dropped."""
        self._hidden = None
        for close in self._closers:
            close()

    def _ran(self, unit: int, started: float, ended: float) -> None:
        with self._lock:
            self._log.started(unit, started)
            self._log.ended(unit, ended)
