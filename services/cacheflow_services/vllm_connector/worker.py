"""The worker side: restore a cached prefix with CacheFlow into vLLM's paged blocks, and store the chunks
vLLM computes.

Restore (before the forward pass that needs it): CacheFlow's runtime runs the restore executor against
the storage pods, so the prefix's front is recomputed while its back is loaded (`policy`); the resulting
[L, 2, Hkv, N, D] KV is scattered into the request's blocks. The runtime is vLLM's own loaded model,
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

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from cacheflow_common.engine import RestoreEngine, RestoreJob, RestoreResult
from cacheflow_common.errors import ConfigError
from cacheflow_common.kv.chunk import encode_kv_chunk
from cacheflow_common.kv.keys import ChunkKey, chunk_keys, object_name, tenant_salt
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.model.weights import checkpoint_fingerprint
from cacheflow_common.restore.cores import move_off_compute_cores
from cacheflow_common.restore.profile import Profile
from cacheflow_common.restore.save import dtype_name, make_job, save_chunks
from cacheflow_common.restore.stages import save_boundaries
from cacheflow_common.store.placement import ClusterStore
from cacheflow_common.transport.pod_client import PodAddress, PodClient
from cacheflow_common.transport.shaping import gbps
from cacheflow_services.vllm_connector.config import ConnectorConfig
from cacheflow_services.vllm_connector.paged import LAYOUTS, check_cache, gather, layer_index, scatter
from cacheflow_services.vllm_connector.plan import LoadSpec, SaveSpec
from cacheflow_services.vllm_connector.ranks import BoundaryCapture, rank_layers
from cacheflow_services.vllm_connector.restorer import engine_settings
from cacheflow_services.vllm_connector.shared import Unsupported, shared_bytes, shared_runtime

log = logging.getLogger(__name__)


def open_store(cfg: ConnectorConfig) -> ClusterStore:
    """Placement over the pods, authenticated as the tenant."""
    token = cfg.token()
    pods = {a.pod_id: PodClient(a, token, timeout_s=cfg.timeout_s) for a in map(PodAddress.parse, cfg.pods)}
    return ClusterStore(pods, replicas=cfg.replicas)  # type: ignore[arg-type]


class StatsLog:
    """One JSON line per event, appended to a file (nothing without a path); totals kept in memory."""

    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None
        self.totals: dict[str, int] = {}
        self._lock = threading.Lock()

    def event(self, kind: str, **fields: Any) -> None:
        with self._lock:
            self.totals[kind] = self.totals.get(kind, 0) + 1
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")


VllmModel = Callable[[], Any]  # vLLM's loaded model module, or None while it cannot be reached


class WorkerEngine:
    def __init__(self, cfg: ConnectorConfig, *, dtype: torch.dtype, block_size: int, device: str,
                 layout: str, vllm_model: VllmModel | None = None, layers: range | None = None) -> None:
        """`vllm_model` finds vLLM's loaded model module (None while it cannot); it is asked now, and if it
        has no answer yet, again at `register` and at the first load, before falling back to a copy.
        `layers`: this pipeline rank's layers, where known before `register` (its copy then loads only them)."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown paged KV layout {layout!r}; known: {LAYOUTS}")
        self.cfg = cfg
        self.layout = layout  # how K and V sit in vLLM's blocks (paged.py)
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.config = ModelConfig.from_dir(cfg.model)
        self.fingerprint = checkpoint_fingerprint(Path(cfg.model), self.config, dtype)  # as the scheduler's
        self._vllm_model = vllm_model or (lambda: None)
        self._model: Transformer | None = None  # CacheFlow's runtime, once chosen
        self.runtime = ""  # "shared" (over vLLM's weights) or "separate" (its own copy), once chosen
        self.store = open_store(cfg)
        self.profile = Profile.load(cfg.profile) if cfg.profile else None
        self.stats = StatsLog(cfg.stats_file)
        self.caches: list[tuple[int, torch.Tensor]] = []  # (decoder layer, its vLLM cache), by layer
        self._expected = layers  # the rank's layers vLLM's split gives, checked at `register`
        self.layers = layers or range(self.config.num_layers)  # this rank's layers [a, b), set at `register`
        self.capture = BoundaryCapture()  # the hidden state entering layer a (ranks with a > 0 that save)
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheflow-saver",
                                         initializer=move_off_compute_cores)
        self._engine: RestoreEngine | None = None  # started at the first restore
        self._choose_runtime(final=False)

    # ------------------------------------------------------------------------------------ runtime
    @property
    def model(self) -> Transformer:
        """CacheFlow's runtime: over vLLM's weights where it can be, else its own copy (chosen once)."""
        if self._model is None:
            self._choose_runtime(final=True)
        assert self._model is not None
        return self._model

    def _choose_runtime(self, *, final: bool) -> None:
        """Wrap vLLM's model if it can be reached and is covered; else, once `final` (or at once where
        sharing cannot work), load the separate runtime, logging why."""
        if self._model is not None:
            return
        if not self.cfg.share_weights:
            self._separate("share_weights is off")
            return
        module = self._vllm_model()
        if module is None:
            if final:
                self._separate("vLLM's loaded model could not be reached from the connector")
            return
        try:
            self._model = shared_runtime(module, self.config, dtype=self.dtype, source=Path(self.cfg.model))
        except Unsupported as exc:
            self._separate(str(exc))
            return
        inside, outside = shared_bytes(self._model, module)
        self.runtime = "shared"
        log.info("CacheFlow recomputes with vLLM's own model (%s): no second copy of the weights",
                 type(module).__name__)
        self.stats.event("runtime", runtime="shared", reason="", shared_bytes=inside, own_bytes=outside)

    def _separate(self, reason: str) -> None:
        log.warning("CacheFlow recomputes with its own copy of the weights from %s: %s", self.cfg.model, reason)
        self._model = Transformer.from_dir(self.cfg.model, dtype=self.dtype, device=self.device, layers=self.layers)
        self.runtime = "separate"
        own = sum(t.numel() * t.element_size() for t in self._model.weights.values())
        self.stats.event("runtime", runtime="separate", reason=reason, shared_bytes=0, own_bytes=own)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._choose_runtime(final=False)
        c = self.config
        self.caches = sorted((layer_index(name), cache) for name, cache in kv_caches.items())
        self.layers = rank_layers([layer for layer, _ in self.caches], c.num_layers)
        if self._expected is not None and self.layers != self._expected:
            raise ConfigError(f"vLLM registered the caches of layers {self.layers}, not this rank's {self._expected}")
        for _, cache in self.caches:
            check_cache(cache, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=self.block_size)
        if self.layers.start > 0:
            log.info("CacheFlow connector on a pipeline rank holding layers [%d, %d)", self.layers.start,
                     self.layers.stop)
        self._attach_capture()

    # ------------------------------------------------------------------------------------ pipeline ranks
    @property
    def captures(self) -> bool:
        """Whether this rank stores boundary activations (a rank after the first that saves)."""
        return self.layers.start > 0 and self.cfg.save

    def _attach_capture(self) -> None:
        if self.captures and not self.capture.attached and (module := self._vllm_model()) is not None:
            self.capture.attach(module)

    def begin_step(self, order: Sequence[tuple[str, int, int]]) -> None:
        """The step's requests in vLLM's batch order: (request id, rows scheduled, prompt length)."""
        if self.captures:
            self._attach_capture()
            self.capture.begin_step(order)

    def finished(self, req_ids: Sequence[str]) -> None:
        for req_id in req_ids:
            self.capture.finish(req_id)

    # ------------------------------------------------------------------------------------ restore
    def load_step(self, specs: Sequence[LoadSpec]) -> set[int]:
        """Restore the prefixes one vLLM step loads into their blocks: together, by the batch engine, when
        there are several (`batch_restores`), else one after another. Returns the block ids vLLM must
        recompute (those of every restore that failed outright, and of misses with `on_miss="vllm"`)."""
        failed: set[int] = set()
        jobs: dict[str, RestoreJob] = {}
        for spec in specs:
            try:
                jobs[spec.req_id] = make_job(self.model, spec.token_ids, tenant=self.cfg.tenant,
                                             chunk_size=self.cfg.chunk_size, layers=self.layers)
            except Exception as exc:
                failed |= self._failed_load(spec, exc)
        together = self.cfg.batch_restores and len(jobs) > 1
        engine, policy = self._restorer(), self._policy()[0]
        outcomes = engine.restore_batch(jobs, self.store, policy) if together else {
            request_id: engine.restore_batch({request_id: job}, self.store, policy)[request_id]
            for request_id, job in jobs.items()}
        for spec in specs:
            outcome = outcomes.get(spec.req_id)
            if isinstance(outcome, Exception):
                failed |= self._failed_load(spec, outcome)
            elif outcome is not None:
                failed |= self._land(spec, jobs[spec.req_id], outcome, batch=len(jobs) if together else 1)
        return failed

    def _failed_load(self, spec: LoadSpec, exc: Exception) -> set[int]:
        """A failed restore is a failed load: vLLM recomputes the prefix."""
        log.error("CacheFlow restore of %s failed (%s: %s); vLLM recomputes it", spec.req_id, type(exc).__name__, exc)
        self.stats.event("load_error", req=spec.req_id, tokens=len(spec.token_ids),
                         error=f"{type(exc).__name__}: {exc}")
        return self._blocks(spec, spec.start)

    def _land(self, spec: LoadSpec, job: RestoreJob, result: RestoreResult, *, batch: int) -> set[int]:
        """Scatter a restored prefix into the request's blocks, log it, and deal with its misses."""
        n = len(spec.token_ids)
        kv = result.kv.data  # [b - a, 2, Hkv, N, D]: this rank's layers
        for layer, cache in self.caches:
            part = kv[layer - result.kv.layer_start, :, :, spec.start : n]  # [2, Hkv, n - start, D]
            scatter(cache, self.layout, spec.block_ids, self.block_size, spec.start, part)
        sources = result.sources()
        self.stats.event("restore", req=spec.req_id, tokens=n, written=n - spec.start, policy=self._policy()[0],
                         mode=result.mode, computed=sources.count("computed"),
                         loaded=sources.count("loaded"), misses=dict(result.misses),
                         bytes_loaded=result.bytes_loaded, elapsed_s=result.elapsed_s, batch=batch,
                         runtime=self.runtime)
        return self._after_misses(spec, job, result)

    def _restorer(self) -> RestoreEngine:
        """The engine every restore runs in, started at the first."""
        if self._engine is None:
            policy, link = self._policy()
            settings = engine_settings(self.cfg, self.layers, self.profile, link, policy)
            self._engine = RestoreEngine(settings, self.model)
        return self._engine

    def _policy(self) -> tuple[str, float | None]:
        """The restore policy and the link its costs are for; the CacheFlow ones need a profile (else Cake)."""
        link = gbps(self.cfg.link_gbps) if self.cfg.link_gbps else None
        if self.cfg.policy.startswith("cacheflow") and self.profile is None:
            return "cake", link
        return self.cfg.policy, link

    def _after_misses(self, spec: LoadSpec, job: RestoreJob, result: RestoreResult) -> set[int]:
        """Chunks that missed: stored again (CacheFlow recomputed them), or handed to vLLM to recompute."""
        missed = [i for i, u in enumerate(result.units) if u.miss_reason]
        if not missed:
            return set()
        if self.cfg.on_miss == "vllm":
            first = job.keys[missed[0]].token_start if result.mode == "token" else 0
            failed = self._blocks(spec, max(first, spec.start))
            self.stats.event("load_error", req=spec.req_id, tokens=len(spec.token_ids), first_failed=first,
                             blocks=len(failed), error="miss")
            return failed
        keys = [job.keys[i] for i in missed] if result.mode == "token" else list(job.keys)
        if self.cfg.save:
            self._saver.submit(self._guarded, save_chunks, result.kv, job, self.store,
                               model_fingerprint=self.fingerprint, keys=keys)
        return set()

    def _blocks(self, spec: LoadSpec, first: int) -> set[int]:
        """The block ids holding positions [first, N) of the spec's prefix."""
        last = -(-len(spec.token_ids) // self.block_size)
        return set(spec.block_ids[first // self.block_size : last])

    # ------------------------------------------------------------------------------------ save
    def save(self, spec: SaveSpec) -> None:
        """Copy the spec's new chunks out of vLLM's blocks, then store them off the forward thread."""
        end = len(spec.token_ids)
        kv = torch.stack([gather(cache, self.layout, spec.block_ids, self.block_size, spec.start, end)
                          for _, cache in self.caches])  # [b - a, 2, Hkv, T, D]
        hidden = None
        if self.captures:
            hidden = self.capture.take(spec.req_id, spec.start, end)  # [T, hidden] entering layer a, or None
            self.capture.release(spec.req_id, end)
        self._saver.submit(self._guarded, self._store_chunks, spec, kv.cpu(), hidden)

    def _store_chunks(self, spec: SaveSpec, kv: torch.Tensor, hidden: torch.Tensor | None = None) -> None:
        """Store the spec's chunks [start, end) for this rank's layers, and (rank after the first) the
        boundary activations entering its first layer, hidden [T, hidden] for tokens [start, end)."""
        every = tuple(chunk_keys(spec.token_ids, self.cfg.chunk_size, tenant_salt(self.fingerprint, self.cfg.tenant)))
        keys = [k for k in every if k.token_start >= spec.start]
        written = sum(self._put(spec, key, kv) for key in keys)
        if self.captures and hidden is None:  # this rank cannot restore these chunks: vLLM will recompute them
            self.stats.event("boundary_missing", req=spec.req_id, chunks=len(keys), layer=self.layers.start)
        elif hidden is not None:
            job = RestoreJob(token_ids=spec.token_ids, keys=every, layers=self.layers, kv_dtype=dtype_name(self.dtype))
            written += save_boundaries(job, hidden.to(self.dtype), self.store, model_fingerprint=self.fingerprint,
                                       keys=keys, first_row_token=spec.start)
        self.stats.event("save", req=spec.req_id, chunks=len(keys), bytes=written, tokens_end=len(spec.token_ids))

    def _put(self, spec: SaveSpec, key: ChunkKey, kv: torch.Tensor) -> int:
        part = kv[:, :, :, key.token_start - spec.start : key.token_end - spec.start]  # [b - a, 2, Hkv, C, D]
        obj = encode_kv_chunk(key=key, token_ids=spec.token_ids[key.token_start : key.token_end],
                              model=self.fingerprint, layer_start=self.layers.start, kv=part,
                              dtype=dtype_name(self.dtype))
        self.store.put(object_name(key, "kv", self.layers.start, self.layers.stop), obj)
        return len(obj)

    def _guarded(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """Saves run off the critical path: a failure is logged and counted (that chunk is recomputed later)."""
        try:
            fn(*args, **kwargs)
        except Exception as exc:
            log.exception("storing chunks in CacheFlow failed")
            self.stats.event("save_error", error=f"{type(exc).__name__}: {exc}")

    def flush(self) -> None:
        """Wait for every queued save."""
        try:
            self._saver.submit(lambda: None).result()
        except RuntimeError:  # the interpreter is exiting: its shutdown hook has run the queued saves already
            return

    def close(self) -> None:
        self.capture.detach()
        if self._engine is not None:
            self._engine.close()
        self.flush()
        self._saver.shutdown()
        for pod in self.store.pods.values():
            close = getattr(pod, "close", None)
            if close is not None:
                close()
        self.store.close()
