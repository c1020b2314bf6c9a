"""The worker side: restore a cached prefix with CacheFlow into vLLM's paged blocks, and store the chunks
vLLM computes.

Restore (in the background while the request waits, `async_loads.py`; or in vLLM's step, before the
forward pass that needs it): CacheFlow's runtime runs the restore engine against the storage pods, so the
prefix's front is recomputed while its back is loaded (`policy`); the resulting [L, 2, Hkv, N, D] KV ends
up in the request's blocks (written there as it is computed, with vLLM's CPU attention kernel attending
over them: `paged_attention.py`; else scattered there at the end). The runtime is vLLM's own loaded model,
wrapped without copying a weight (shared.py); only where the wrapper does not cover the model (or
`share_weights` is off) does CacheFlow load a second copy of the weights from the model directory.
A chunk that misses is recomputed inside the restore (`on_miss="cacheflow"`) or reported to vLLM as a
failed load (`on_miss="vllm"`), which recomputes from the first failed block; a restore that fails
outright reports all its blocks. Either way the output is never wrong.

Save (after the forward pass): the finished chunks' KV is copied out of vLLM's blocks (the only work on
the forward thread) and a saver thread encodes and stores them, with the same keys and chunk format as
CacheFlow's stage workers, so a CacheFlow cluster and vLLM instances share chunks.

Pipeline parallelism: the engine holds its vLLM rank's layers [a, b) (those of the caches vLLM registers),
a CacheFlow stage. Its chunks are named for [a, b) exactly as a stage worker with that split names them;
a rank with a > 0 also stores the boundary activation entering layer a of each chunk (captured by
`ranks.BoundaryCapture`) and restores from the stored ones, so every rank restores at once, on its own.
A rank missing a boundary reports the whole load as failed: vLLM recomputes it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from cacheflow_common.engine import Engine, RestoreJob, RestoreResult
from cacheflow_common.errors import ConfigError
from cacheflow_common.kv.chunk import TORCH_DTYPES
from cacheflow_common.kv.keys import ChunkKey
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.boundary import BOUNDARY_KIND
from cacheflow_common.restore.profile import Profile
from cacheflow_common.restore.save import dtype_name, make_job
from cacheflow_common.sched.calibration import Calibration
from cacheflow_common.sched.policies import make_policy, usable_policy
from cacheflow_common.transport.shaping import gbps
from cacheflow_services.vllm_connector.async_loads import AsyncLoads
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.both_sides import StatsLog, blocks_from, open_store
from cacheflow_services.vllm_connector.config import ConnectorConfig
from cacheflow_services.vllm_connector.draft import DraftPass, Restored, keep_draft_rows, restore_drafts
from cacheflow_services.vllm_connector.draft_kv import DraftCaches, draft_caches
from cacheflow_services.vllm_connector.model_identity import (
    KVGeometry,
    chunk_fingerprint,
    kv_dtype,
    model_fingerprint,
    rank_heads,
    salted,
)
from cacheflow_services.vllm_connector.paged import (
    LAYOUTS,
    check_cache,
    draft_layer,
    gather_layers,
    layer_index,
    scatter,
)
from cacheflow_services.vllm_connector.paged_attention import PagedKV
from cacheflow_services.vllm_connector.plan import LoadSpec, PromptRows, SaveSpec
from cacheflow_services.vllm_connector.planned_fronts import step_token_budget
from cacheflow_services.vllm_connector.planned_loads import PlannedLoads
from cacheflow_services.vllm_connector.planned_split import (
    RunningSplit,
    Split,
    SplitPlan,
    chunk_load_times,
    front_compute_s,
    latest_fronts,
    planned_front,
    start_splits,
)
from cacheflow_services.vllm_connector.ranks import (
    ONE_RANK,
    BoundaryCapture,
    RowShare,
    StepSlots,
    rank_layers,
    tensor_parallel_agree,
    tensor_parallel_min,
)
from cacheflow_services.vllm_connector.restorer import PREFILL_TOKENS, engine_settings
from cacheflow_services.vllm_connector.runtime import Drafter, LoraManager, RuntimeChoice, VllmModel
from cacheflow_services.vllm_connector.saves import ConnectorSaves
from cacheflow_services.vllm_connector.support import (
    OnceLog,
    draft_reads_output,
    draft_reads_rows,
    draft_sources,
    restores_draft,
)
from cacheflow_services.vllm_connector.vllm_runtime import VllmRuntime

log = logging.getLogger(__name__)


class WorkerEngine:
    def __init__(self, cfg: ConnectorConfig, *, dtype: torch.dtype, block_size: int, device: str,
                 layout: str, vllm_model: VllmModel | None = None, layers: range | None = None,
                 attention_isa: str = "", vllm_config: Any = None, tp_rank: int | None = None,
                 step_slots: StepSlots | None = None, lora_manager: LoraManager = lambda model: None,
                 drafter: Drafter = lambda model: None) -> None:
        """`vllm_model` finds vLLM's loaded model module (None while it cannot); it is asked now, and if it
        has no answer yet, again at `register` and at the first load, before falling back to a copy.
        `layers`: this pipeline rank's layers, where known before `register` (its copy then loads only them).
        `attention_isa`: vLLM's CPU attention kernel, where CacheFlow's runtime attends with it (`PagedKV`); "":
        CacheFlow's. `vllm_config`: vLLM's, which `runtime: "vllm"` runs vLLM's model with. `tp_rank`: this
        rank's, under tensor parallelism (its chunks hold its KV heads). `step_slots`: the slot mapping of the forward
        running now (vLLM's forward context), which files a pipeline rank's boundary rows by request.
        `lora_manager` finds, for vLLM's model, its runner's LoRA manager (LoRA on: vLLM's model recomputes under
        each request's adapter); `drafter`, its runner's draft model (an EAGLE or MTP draft, a draft model:
        restores rerun it, draft.py)."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown paged KV layout {layout!r}; known: {LAYOUTS}")
        self.cfg = cfg
        self.layout = layout  # how K and V sit in vLLM's blocks (paged.py)
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        vllm_runtime = cfg.runtime == "vllm" and vllm_config is not None
        self.config = KVGeometry.from_vllm(vllm_config) if vllm_runtime else ModelConfig.from_dir(cfg.model)
        self.tp_rank = tp_rank
        self.fingerprint = chunk_fingerprint(Path(cfg.model), vllm_config, layout) \
            if vllm_config is not None else model_fingerprint(Path(cfg.model), dtype)  # as the scheduler's
        self.heads = rank_heads(vllm_config, tp_rank) if vllm_config is not None else None  # its chunks hold these
        # the chunks whose stored rows (a draft's, a pipeline rank's boundary) this rank stores and reads
        self.row_share = ONE_RANK if tp_rank is None or vllm_config is None else \
            RowShare(tp_rank, vllm_config.parallel_config.tensor_parallel_size)
        self.kv_dtype = kv_dtype(vllm_config) if vllm_config is not None else dtype_name(dtype)  # chunks' dtype
        self._vllm_model = vllm_model or (lambda: None)
        self.store = open_store(cfg)
        self.profile = Profile.load(cfg.profile) if cfg.profile else None
        self.stats = StatsLog(cfg.stats_file)
        self._runtime = RuntimeChoice(cfg.model, self.config, runtime=cfg.runtime, share_weights=cfg.share_weights,
                                      dtype=dtype, device=device, vllm_model=self._vllm_model, vllm_config=vllm_config,
                                      fingerprint=self.fingerprint, event=self.stats.event,
                                      lora_manager=lora_manager)
        self._lora_on = vllm_config is not None and vllm_config.lora_config is not None
        self.draft_method = restores_draft(vllm_config) if vllm_config is not None else ""  # a draft's with KV
        self.drafts = bool(self.draft_method)  # restores rerun the draft (draft.py)
        self.draft_rows = vllm_config is not None and draft_reads_rows(vllm_config)  # over the target's rows too
        self.draft_output = vllm_config is not None and draft_reads_output(vllm_config)  # its output rows (EAGLE, MTP)
        # the rows the scheduler's lookup asks each chunk for
        self.draft_sources = draft_sources(vllm_config, self.config.num_layers) if self.draft_rows else []
        self._drafter = drafter
        self._draft: DraftPass | None = None  # at the first restore that reruns the draft
        self._vllm_config = vllm_config
        self.draft_kv: DraftCaches | None = None  # the draft's caches, whose KV chunks also hold (at `register`)
        self._once = OnceLog()
        self.saves = ConnectorSaves(self.store, self.stats.event, fingerprint=self.fingerprint, dtype=dtype,
                                    kv_dtype=self.kv_dtype, heads=self.heads, row_share=self.row_share,
                                    chunk_size=cfg.chunk_size, tenant=cfg.tenant)
        self.caches: list[tuple[int, torch.Tensor]] = []  # (decoder layer, its vLLM cache), by layer
        self._expected = layers  # the rank's layers vLLM's split gives, checked at `register`
        self.layers = layers or range(self.config.num_layers)  # this rank's layers [a, b), set at `register`
        self.capture = BoundaryCapture(step_slots)  # the hidden state entering layer a (ranks with a > 0 that save)
        self._first_layer = ""  # the name of the rank's first attention layer, set at `register`
        self.policy, self.link = connector_policy(cfg, self.profile)  # the link: bytes/s, if known
        self.calibration = Calibration()  # planned restores' measured / predicted times (planned_split.py)
        self.front_step_tokens = cfg.front_step_tokens or step_token_budget(vllm_config)  # fronts' tokens per step
        self.attention_isa = attention_isa if cfg.attention == "vllm" else ""
        self._engine: Engine | None = None  # started at the first restore
        self._async = AsyncLoads(self, timeout_s=cfg.restore_timeout_s) if cfg.async_loads else None
        self._planned = PlannedLoads(self, timeout_s=cfg.restore_timeout_s) if cfg.async_loads else None
        self._runtime.choose(self.layers, final=False)

    # ------------------------------------------------------------------------------------ runtime
    @property
    def model(self) -> Transformer:
        """CacheFlow's runtime: over vLLM's weights where it can be, else its own copy (chosen once)."""
        self._runtime.choose(self.layers, final=True)
        assert self._runtime.model is not None
        return self._runtime.model

    @property
    def runtime(self) -> str:
        """"shared" (over vLLM's weights) or "separate" (its own copy), once chosen; "" before."""
        return self._runtime.kind

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._runtime.choose(self.layers, final=False)
        c = self.config
        # a draft's layers are not the target's: their KV is stored apart (draft_kv.py), or rerun (draft.py)
        drafted = {name: cache for name, cache in kv_caches.items() if draft_layer(name, c.num_layers)}
        kv_caches = {name: cache for name, cache in kv_caches.items() if name not in drafted}
        self.draft_kv = self._draft_caches(drafted)
        self.caches = sorted((layer_index(name), cache) for name, cache in kv_caches.items())
        self._first_layer = min(kv_caches, key=layer_index)
        self.layers = rank_layers([layer for layer, _ in self.caches], c.num_layers)
        if self._expected is not None and self.layers != self._expected:
            raise ConfigError(f"vLLM registered the caches of layers {self.layers}, not this rank's {self._expected}")
        for _, cache in self.caches:
            check_cache(cache, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=self.block_size)
        if self.layers.start > 0:
            log.info("CacheFlow connector on a pipeline rank holding layers [%d, %d)", self.layers.start,
                     self.layers.stop)
        self._attach_capture()

    def _draft_caches(self, drafted: dict[str, torch.Tensor]) -> DraftCaches | None:
        """The draft's caches, whose KV is stored and loaded with the chunks (`draft_kv`: on; a draft whose KV
        restores recompute), else None: its KV is rerun (draft.py). One that cannot be named is logged, once."""
        if not (self.drafts and self.cfg.draft_kv and drafted and self._vllm_config is not None):
            return None
        try:
            return draft_caches(drafted, self._vllm_config, target_fingerprint=self.fingerprint, layout=self.layout,
                                block_size=self.block_size,
                                heads=rank_heads(self._vllm_config, self.tp_rank,
                                                 self._vllm_config.speculative_config.draft_model_config))
        except Exception as exc:  # its checkpoint unreadable, say: restores rerun the draft, as without it
            log.warning("CacheFlow stores no draft KV (%s: %s): restores rerun the draft", type(exc).__name__, exc)
            return None

    # ------------------------------------------------------------------------------------ pipeline ranks
    @property
    def captures(self) -> bool:
        """Whether this rank stores boundary activations (a rank after the first that saves), or the model's
        output rows (an EAGLE or MTP draft's input, draft.py)."""
        return (self.layers.start > 0 or self.draft_rows) and self.cfg.save

    def captured(self) -> list[tuple[int, str]]:
        """How the captured rows are stored, side by side (layer, kind): the boundary activations entering the
        rank's first layer; with an EAGLE or MTP draft the model's output rows, at its layer count; with an
        EAGLE-3 draft the boundary activations at each of its auxiliary layers."""
        if self.draft_output:
            return self.draft_sources
        if self.draft_method == "eagle3":
            return [(layer, BOUNDARY_KIND) for layer in aux_layers(self._vllm_model())]
        return [(self.layers.start, BOUNDARY_KIND)]

    def draft_inputs(self) -> list[tuple[int, str]]:
        """The stored rows a restore's draft reads, side by side (layer, kind); none without a draft that reads
        the target's rows."""
        return self.captured() if self.draft_rows else []

    def rows_with_loads(self) -> list[tuple[int, str]]:
        """The stored rows read with each chunk a restore loads, for its draft's rerun (`draft_inputs`): none where
        the draft's own KV is stored with the chunks (draft_kv.py): the rerun reads rows only where it is missing."""
        return [] if self.draft_kv is not None else self.draft_inputs()

    def begin_step(self, rows: PromptRows) -> None:
        """Where the step's prompt rows go, before its forward."""
        if self.captures:
            self._attach_capture()
            self.capture.begin_step(rows)

    def _attach_capture(self) -> None:
        """Hook the boundary capture into vLLM's model once it can be reached (ranks that store boundaries)."""
        if self.captures and not self.capture.attached and (module := self._vllm_model()) is not None:
            self.capture.attach(module, self._first_layer, output=self.draft_rows)
            self._check_aux_layers(module)

    def _check_aux_layers(self, module: Any) -> None:
        """An EAGLE-3 draft's rows are stored at the layers vLLM's model returns them for, which the scheduler's
        lookup reads from vLLM's config (`eagle3_aux_layers`); where the model overrides that choice, the lookup
        finds no chunk (nothing is restored, nothing wrong)."""
        looked_up = [layer for layer, _ in self.draft_sources]
        if self.draft_method == "eagle3" and (own := aux_layers(module)) != looked_up:
            log.warning("vLLM's model returns the residual streams entering layers %s for its EAGLE-3 draft, not %s as "
                        "CacheFlow's lookup reads from its config: no chunk will be found to restore", own, looked_up)

    def finished(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self.capture.finish(req_id)

    # ------------------------------------------------------------------------------------ restore
    def load_step(self, specs: Sequence[LoadSpec]) -> set[int]:
        """Restore the prefixes one vLLM step loads into their blocks: together, by the batch engine, when
        there are several (`batch_restores`), else one after another; with a meeting point planned up front
        on tensor-parallel ranks and by loads alone where nothing may recompute them (`_restore_planned`).
        Returns the block ids vLLM must recompute (those of every restore that failed outright, and of misses
        with `on_miss="vllm"`)."""
        specs = [self.under_adapters(spec) for spec in specs]
        planned = [s for s in specs if self._plans_ahead(s)]
        failed = self._restore_planned(planned) if planned else set()
        specs = [s for s in specs if s not in planned]
        if not specs:
            return failed
        jobs: dict[str, RestoreJob] = {}
        kvs: dict[str, KVBuffer] = {}
        for spec in specs:
            try:
                jobs[spec.req_id] = self.job(spec)
                kvs[spec.req_id] = self.buffer(spec, jobs[spec.req_id])
            except Exception as exc:
                failed |= self.failed_load(spec, exc)
        together = self.cfg.batch_restores and len(jobs) > 1
        engine, policy = self.engine(), self.policy
        outcomes = engine.restore_batch(jobs, self.store, policy, kvs=kvs) if together else {
            request_id: engine.restore_batch({request_id: job}, self.store, policy, kvs=kvs)[request_id]
            for request_id, job in jobs.items()}
        for kv in kvs.values():
            kv.seal()  # a restore that failed may still have a load in flight: it must not write once vLLM knows
        for spec in specs:
            outcome = outcomes.get(spec.req_id)
            if isinstance(outcome, Exception):
                failed |= self.failed_load(spec, outcome)
            elif outcome is not None:
                failed |= self.land(spec, jobs[spec.req_id], outcome, batch=len(jobs) if together else 1)
        return failed

    def under_adapters(self, spec: LoadSpec) -> LoadSpec:
        """`spec` as it may run with LoRA on: by loads alone where vLLM's model cannot recompute it under its
        adapter, or without one (`adapters.py`); each reason logged once."""
        if spec.load_only or not self._lora_on:
            return spec
        try:
            model = self.model
        except Exception:  # vLLM's model out of reach: the restore fails where it needs it, vLLM recomputes
            return spec
        if not isinstance(model, VllmRuntime):
            return spec
        scope = model.adapters
        reason = scope.unusable(spec.adapter) if scope is not None else "vLLM's LoRA manager could not be reached"
        if not reason:
            return spec
        self._once.warn("CacheFlow restores by loads alone where LoRA keeps it from recomputing: %s", reason)
        self.stats.event("load_only", req=spec.req_id, reason=reason)
        return replace(spec, load_only=True)

    def _plans_ahead(self, spec: LoadSpec) -> bool:
        """Whether a restore's meeting point is planned before it starts (planned_split.py): on tensor-parallel
        ranks, and for restores by loads alone."""
        return spec.load_only or self.tp_rank is not None

    def _restore_planned(self, specs: Sequence[LoadSpec]) -> set[int]:
        """Planned restores in vLLM's step, started together (every tensor-parallel rank runs the same forwards):
        each front recomputed with vLLM's model while its back loads, up to the first miss; vLLM recomputes the
        rest."""
        started = time.perf_counter()
        failed: set[int] = set()
        restored = []
        for spec, running in zip(specs, self.start_splits(specs), strict=True):
            if isinstance(running, BaseException):
                failed |= self.failed_load(spec, running)
                restored.append(Restored(spec, None, None, spec.start))
                continue
            running.join()
            done = running.result()
            failed |= self.split_done(spec, done, elapsed_s=time.perf_counter() - started, asynchronous=False)
            restored.append(Restored(spec, running.job, running.kv, done.end))
        return failed | self.rerun_drafts(restored) if self.drafts else failed

    def start_splits(self, specs: Sequence[LoadSpec], *, on_loaded: Callable[[], None] = lambda: None,
                     in_steps: bool = False) -> list[RunningSplit | BaseException]:
        """Planned restores started together: each back loading on a thread, every front recomputed in shared
        forwards: all of them before this returns, or (`in_steps`) the first step of them, the rest in the splits'
        `fronts`, a step at a time (`front_step_tokens`). A restore that cannot start is its error instead (a
        front that fails fails every restore of the step: they shared its forwards)."""
        model = self.model if isinstance(self.model, VllmRuntime) else None
        costs = self.profile.cost_model(self.link) if self.profile is not None else None
        sources = self.rows_with_loads()
        plans: list[SplitPlan | BaseException] = []
        for spec in specs:
            try:
                job = self.job(spec)
                load_s: list[float] = chunk_load_times(
                    job, costs, model.kv_bytes_per_token_per_layer,
                    row_bytes=len(sources) * self.config.hidden_size * model.dtype.itemsize // self.row_share.ranks,
                ) if costs and model else []
                front = spec.start if spec.load_only or model is None else planned_front(
                    job, start=spec.start, costs=costs, policy=make_policy(self.policy),
                    load_s=[seconds * self.calibration.load_scale for seconds in load_s],
                    compute_scale=self.calibration.compute_scale)
                plans.append(SplitPlan(job, self._block_kv(spec, job), spec.start, front, load_s))
            except Exception as exc:
                plans.append(exc)
        if self.tp_rank is not None and costs is not None and model is not None:
            plans = latest_fronts(plans, self.agree_min)  # each rank's follow its own measurements
        started = [p for p in plans if isinstance(p, SplitPlan)]
        predicted_s = sum(front_compute_s(p, costs) for p in started) if costs is not None else 0.0
        try:
            running = iter(start_splits(started, self.store, model, prefill_tokens=PREFILL_TOKENS,
                                        step_tokens=self.front_step_tokens if in_steps else None,
                                        on_loaded=on_loaded, agree=self._agree, draft_sources=sources,
                                        on_fronts_done=lambda seconds: self._fronts_timed(predicted_s, seconds),
                                        row_share=self.row_share))
        except Exception as exc:  # the shared fronts failed: every restore that started fails with them
            return [p if isinstance(p, BaseException) else exc for p in plans]
        return [p if isinstance(p, BaseException) else next(running) for p in plans]

    def _fronts_timed(self, predicted_s: float, measured_s: float) -> None:
        """Learn from a step's fronts (the process's first may be vLLM's warm-up: `Calibration.compute_measured`)."""
        if self.cfg.calibrate:
            self.calibration.compute_measured(predicted_s, measured_s)

    def _agree(self, ok: bool) -> bool:
        """Whether `ok` holds on every tensor-parallel rank of this pipeline rank (with none, this one's)."""
        return ok if self.tp_rank is None else tensor_parallel_agree(ok)

    def agree_min(self, values: list[int]) -> list[int]:
        """Each of `values` at its least over the tensor-parallel ranks (with none, this one's)."""
        return values if self.tp_rank is None else tensor_parallel_min(values)

    def split_done(self, spec: LoadSpec, done: Split, *, elapsed_s: float, asynchronous: bool) -> set[int]:
        """Log a planned restore that ended, learn from its loads' times; the blocks vLLM must recompute (from its
        first miss on)."""
        for predicted_s, measured_s in done.timed if self.cfg.calibrate else ():  # each chunk's, as the
            self.calibration.loads_measured(predicted_s, measured_s)  # batch scheduler learns from each load
        self.stats.event("restore", req=spec.req_id, tokens=len(spec.token_ids), written=done.end - spec.start,
                         policy=self.policy if done.computed else "load-only", mode="token",
                         computed=done.computed, loaded=done.loaded, misses={done.miss: 1} if done.miss else {},
                         bytes_loaded=done.bytes_read, boundary_bytes_read=done.boundary_bytes_read,
                         batch=done.batch, elapsed_s=elapsed_s, runtime=self.runtime,
                         asynchronous=asynchronous, attention="vllm", tp_rank=self.tp_rank, load_s=done.load_s,
                         predicted_load_s=done.predicted_load_s, load_scale=self.calibration.load_scale,
                         compute_scale=self.calibration.compute_scale, front_steps=done.front_steps,
                         layers=[self.layers.start, self.layers.stop])
        return blocks_from(spec, done.end, self.block_size) if done.miss else set()

    def start_loads(self, specs: Sequence[LoadSpec]) -> None:
        """Restore prefixes in the background (`async_loads`, `planned_loads`); `finished_loads` reports them."""
        assert self._async is not None and self._planned is not None, "start_loads needs async_loads"
        specs = [self.under_adapters(spec) for spec in specs]
        planned = [spec for spec in specs if self._plans_ahead(spec)]
        if planned:
            self._planned.start(planned)
        if len(planned) < len(specs):
            self._async.start([spec for spec in specs if not self._plans_ahead(spec)])

    def finished_loads(self, finished_requests: Sequence[str] | set[str], *, idle: bool) -> tuple[set[str], set[int]]:
        """Background restores that ended since the last call, and the block ids vLLM must recompute."""
        if self._async is None or self._planned is None:
            return set(), set()
        done, failed = self._async.collect(finished_requests, idle=idle)  # drives the engine's restores, if any
        planned_done, planned_failed = self._planned.collect(finished_requests, idle=idle and not self._async.in_flight)
        return done | planned_done, failed | planned_failed

    def job(self, spec: LoadSpec) -> RestoreJob:
        return make_job(self.model, spec.token_ids, tenant=self.cfg.tenant, chunk_size=self.cfg.chunk_size,
                        layers=self.layers, kv_dtype=self.kv_dtype, fingerprint=salted(self.fingerprint, spec.salt),
                        heads=self.heads)

    def buffer(self, spec: LoadSpec, job: RestoreJob) -> KVBuffer:
        """The restore's KV: also written into the request's blocks and attended over there with vLLM's CPU
        kernel where it runs (`attention_isa`), else CacheFlow's own buffer and attention."""
        n = max(1, len(job.token_ids))
        if isinstance(self.model, VllmRuntime):
            return self._block_kv(spec, job)
        if not self.attention_isa:
            return self.model.new_kv(job.layers, n)
        return PagedKV(self.config, layers=job.layers, capacity=n, dtype=self.model.dtype,
                       caches=dict(self.caches), block_ids=spec.block_ids, block_size=self.block_size,
                       isa=self.attention_isa, first_writable=spec.start)

    def after_chunk(self, job: RestoreJob, kv: KVBuffer) -> Callable[[int], None] | None:
        """What a background restore in the engine does after each chunk it loads: read the rows its draft reads
        there with it (as planned restores do)."""
        sources = self.rows_with_loads()
        return keep_draft_rows(job, kv, self.store, sources, self.row_share) if sources and isinstance(kv, BlockKV) \
            else None

    def event(self, kind: str, **fields: Any) -> None:
        self.stats.event(kind, **fields)

    def _block_kv(self, spec: LoadSpec, job: RestoreJob) -> BlockKV:
        kv = BlockKV(layers=job.layers, num_kv_heads=self.config.num_kv_heads, head_dim=self.config.head_dim,
                     capacity=max(1, len(job.token_ids)), dtype=TORCH_DTYPES[self.kv_dtype],
                     caches=dict(self.caches), layout=self.layout, block_ids=spec.block_ids,
                     block_size=self.block_size, first_writable=spec.start, adapter=spec.adapter)
        if self.draft_rows:
            kv.keep_outputs()  # the draft reruns over what vLLM's model computes
        return kv

    def failed_load(self, spec: LoadSpec, exc: BaseException) -> set[int]:
        """A failed restore is a failed load: vLLM recomputes the prefix."""
        log.error("CacheFlow restore of %s failed (%s: %s); vLLM recomputes it", spec.req_id, type(exc).__name__, exc,
                  exc_info=exc)  # its traceback: a restore fails on a bug or a configuration it missed
        self.stats.event("load_error", req=spec.req_id, tokens=len(spec.token_ids),
                         error=f"{type(exc).__name__}: {exc}")
        return blocks_from(spec, spec.start, self.block_size)

    def land(self, spec: LoadSpec, job: RestoreJob, result: RestoreResult, *, batch: int) -> set[int]:
        """Put a restored prefix into the request's blocks, log it, and deal with its misses."""
        n = len(spec.token_ids)
        if isinstance(result.kv, PagedKV):  # what it computed is there already: the loaded positions
            result.kv.fill_all(n)
        elif not isinstance(result.kv, BlockKV):  # a BlockKV's loads and computes went into the blocks
            kv = result.kv.data  # [b - a, 2, Hkv, N, D]: this rank's layers
            for layer, cache in self.caches:
                part = kv[layer - result.kv.layer_start, :, :, spec.start : n]  # [2, Hkv, n - start, D]
                scatter(cache, self.layout, spec.block_ids, self.block_size, spec.start, part)
        sources = result.sources()
        self.stats.event("restore", req=spec.req_id, tokens=n, written=n - spec.start, policy=self.policy,
                         mode=result.mode, computed=sources.count("computed"),
                         loaded=sources.count("loaded"), misses=dict(result.misses),
                         bytes_loaded=result.bytes_loaded, boundary_bytes_read=result.boundary_bytes_read,
                         elapsed_s=result.elapsed_s, batch=batch,
                         runtime=self.runtime, asynchronous=self._async is not None,
                         attention="vllm" if isinstance(result.kv, PagedKV | BlockKV) else "cacheflow",
                         layers=[self.layers.start, self.layers.stop])
        failed = self._after_misses(spec, job, result)
        if self.drafts and isinstance(result.kv, BlockKV):
            end = restored_end(spec, failed, self.block_size)
            failed |= self.rerun_drafts([Restored(spec, job, result.kv, end)])
        return failed

    def rerun_drafts(self, restored: Sequence[Restored]) -> set[int]:
        """Rerun the draft over what each restore wrote (draft.py); the blocks vLLM must recompute (from where a
        draft stopped: a chunk without the rows an EAGLE or MTP draft reads, or a draft that could not run)."""
        try:
            reached = restore_drafts(restored, self._draft_pass, self.store, agree=self.agree_min,
                                     event=self.stats.event, share=self.row_share, stored=self._stored_draft)
        except Exception as exc:  # a forward that failed: vLLM recomputes all of it
            return set().union(*(self.failed_load(r.spec, exc) for r in restored))
        return set().union(*(blocks_from(r.spec, end, self.block_size) for r, end in zip(restored, reached, strict=True)
                             if end < r.end))

    def _stored_draft(self, r: Restored) -> tuple[int, int]:
        """Load the stored draft KV of a restore (draft_kv.py): where what it loaded ends, and its bytes."""
        if self.draft_kv is None or r.job is None:
            return r.spec.start, 0
        return self.draft_kv.load(self.store, r.job, start=r.spec.start, end=r.end, next_token=r.spec.next_token,
                                  block_ids=r.spec.block_ids)

    def _draft_pass(self) -> DraftPass:
        """vLLM's draft model over vLLM's model's forward contexts (found at the first restore)."""
        if self._draft is None:
            model = self.model
            if not isinstance(model, VllmRuntime):
                raise ConfigError("a draft's KV is restored with vLLM's own model only")
            drafter = self._drafter(model.module)
            if drafter is None:
                raise RuntimeError("vLLM's draft model could not be reached from the connector")
            self._draft = DraftPass(model, drafter, sources=self.draft_inputs(),
                                    combine=self.draft_method == "eagle3")
        return self._draft

    def engine(self) -> Engine:
        """The engine every restore runs in, started at the first; its compute loop runs on vLLM's thread
        (in the step, or between steps for background restores: `async_loads.py` says why)."""
        if self._engine is None:
            settings = engine_settings(self.cfg, self.layers, self.profile, self.link, self.policy,
                                       num_layers=self.config.num_layers,
                                       paged_attention=bool(self.attention_isa) or self.runtime == "vllm",
                                       token_only=self.runtime == "vllm")
            self._engine = Engine.for_connector(settings, self.model)
        return self._engine

    def _after_misses(self, spec: LoadSpec, job: RestoreJob, result: RestoreResult) -> set[int]:
        """Chunks that missed: stored again (CacheFlow recomputed them), or handed to vLLM to recompute."""
        missed = [i for i, u in enumerate(result.units) if u.miss_reason]
        if not missed:
            return set()
        if self.cfg.on_miss == "vllm":
            first = job.keys[missed[0]].token_start if result.mode == "token" else 0
            failed = blocks_from(spec, max(first, spec.start), self.block_size)
            self.stats.event("load_error", req=spec.req_id, tokens=len(spec.token_ids), first_failed=first,
                             blocks=len(failed), error="miss")
            return failed
        keys = [job.keys[i] for i in missed] if result.mode == "token" else list(job.keys)
        if self.cfg.save:
            self.saves.store_again(spec.req_id, [(key, _recomputed(result.kv, key)) for key in keys], job,
                                   salt=spec.salt)
        return set()

    # ------------------------------------------------------------------------------------ save
    def save(self, spec: SaveSpec) -> None:
        """Copy the spec's new chunks out of vLLM's blocks, then store them off the forward thread."""
        end = len(spec.token_ids)
        kv = gather_layers([cache for _, cache in self.caches], self.layout, spec.block_ids, self.block_size,
                           spec.start, end)  # [b - a, 2, Hkv, T, D]
        hidden = None
        if self.captures:
            hidden = self.capture.take(spec.req_id, spec.start, end)  # [T, hidden] entering that layer, or None
            self.capture.release(spec.req_id, end)
        # the draft's KV of these positions is in the blocks too: vLLM drafted before this call (draft_kv.py)
        draft = None if self.draft_kv is None else \
            (self.draft_kv.gather(spec.block_ids, spec.start, end).cpu(), self.draft_kv)
        self.saves.store_new(spec, kv.cpu(), hidden, self.layers, captured=self.captured() if self.captures else None,
                             draft=draft)

    def flush(self) -> None:
        """Wait for every queued save."""
        self.saves.flush()

    def close(self) -> None:
        self.capture.detach()
        if self._async is not None:
            self._async.close()
        if self._planned is not None:
            self._planned.close()
        if self._engine is not None:
            self._engine.close()
        self.saves.close()
        for pod in self.store.pods.values():
            close = getattr(pod, "close", None)
            if close is not None:
                close()
        self.store.close()


def aux_layers(module: Any) -> list[int]:
    """The layers whose entering residual streams vLLM's model returns for an EAGLE-3 draft, in the order it
    returns them (layer order)."""
    return sorted(set(getattr(getattr(module, "model", module), "aux_hidden_state_layers", ())))


def restored_end(spec: LoadSpec, failed: set[int], block_size: int) -> int:
    """Where what a restore wrote ends: the first of its blocks vLLM must recompute, or its prefix's end."""
    starts = [i * block_size for i, block in enumerate(spec.block_ids) if block in failed]
    return max(spec.start, min(starts, default=len(spec.token_ids)))


def connector_policy(cfg: ConnectorConfig, profile: Profile | None) -> tuple[str, float | None]:
    """The restore policy and the link its costs are for; the CacheFlow ones need a profile (`usable_policy`),
    and vLLM's own model restores token-wise."""
    link = gbps(cfg.link_gbps) if cfg.link_gbps else None
    policy = usable_policy(make_policy(cfg.policy), profiled=profile is not None)[0]
    if cfg.runtime == "vllm" and policy.mode == "layer":
        log.warning("policy %s restores layer-wise; vLLM's model restores token-wise: cacheflow-token", policy.name)
        return "cacheflow-token", link
    return policy.name, link


def _recomputed(kv: KVBuffer, key: ChunkKey) -> torch.Tensor:
    """The chunk's KV as a restore recomputed it, in host memory for the saver's thread: [L, 2, Hkv, C, D]
    (vLLM's model wrote a BlockKV's into the blocks)."""
    if isinstance(kv, BlockKV):
        return kv.gather(key.token_start, key.token_end).cpu()
    return kv.data[:, :, :, key.token_start : key.token_end].cpu()
