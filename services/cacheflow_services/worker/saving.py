"""Storing what a stage computed, off the critical path: one saver thread per worker.

* Whole chunks are stored as a request's tokens fill them (`save_filled`), and a prompt's partial last
  chunk as its own object (`save_tail`), so the prompt restores whole next time; stages s > 0 store the
  boundary activation entering their first layer beside the KV.
* After a restore, the chunks it recomputed because their load missed are stored again
  (`save_recomputed`).
A failed save is logged and counted; the chunk is recomputed by a later restore.
"""

from __future__ import annotations

import torch

from cacheflow_common.engine import StageRequest, StageRestore
from cacheflow_common.kv.keys import ChunkKey
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.boundary import save_boundaries
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.save import make_job, save_chunks
from cacheflow_common.restore.saver_thread import SaverThread
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.worker.metrics import WorkerMetrics


class ChunkSaver:
    def __init__(self, model: Transformer, *, stage: int, layers: range, chunk_size: int,
                 metrics: WorkerMetrics) -> None:
        self.model = model
        self.stage = stage
        self.layers = layers
        self.chunk_size = chunk_size
        self.metrics = metrics
        self._thread = SaverThread(f"stage-{stage}-saver", lambda request_id, exc: metrics.save_failures.inc())

    def save_recomputed(self, job: RestoreJob, restore: StageRestore, store: ChunkStore) -> None:
        """Store again the chunks a restore recomputed because their load missed."""
        missed = restore.missed_units()
        if not missed:
            return
        keys = [job.keys[i] for i in missed] if restore.spec.mode == "token" else list(job.keys)
        fingerprint = self.model.fingerprint()
        self._thread.submit(restore.request_id,
                            lambda: save_chunks(restore.kv, job, store, model_fingerprint=fingerprint, keys=keys))

    def save_filled(self, request: StageRequest, store: ChunkStore) -> None:
        """Queue the whole chunks that filled up since the last save: KV, and the boundary (stage > 0)."""
        size = self.chunk_size
        whole = len(request.token_ids) // size * size
        if whole <= request.saved_tokens or request.kv is None or request.unsaved_input is None:
            return
        job = make_job(self.model, request.token_ids[:whole], tenant=request.tenant, chunk_size=size,
                       layers=self.layers)
        keys = [k for k in job.keys if k.token_start >= request.saved_tokens]
        inputs, first, kv = request.unsaved_input, request.saved_tokens, request.kv
        request.unsaved_input = inputs[whole - first :]
        request.saved_tokens = whole
        self._thread.submit(request.request_id, lambda: self._store(kv, job, keys, inputs, first, store))

    def save_tail(self, request: StageRequest, store: ChunkStore) -> None:
        """Queue the partial last chunk (KV and boundary) as its own object; whole chunks still come later."""
        if len(request.token_ids) == request.saved_tokens or request.kv is None or request.unsaved_input is None:
            return
        job = make_job(self.model, request.token_ids, tenant=request.tenant, chunk_size=self.chunk_size,
                       layers=self.layers)
        tail = job.keys[-1]
        if tail.token_start != request.saved_tokens:  # a restored prefix ended mid-chunk: its inputs are gone
            return
        inputs, first, kv = request.unsaved_input, request.saved_tokens, request.kv
        self._thread.submit(request.request_id, lambda: self._store(kv, job, [tail], inputs, first, store))

    def flush(self) -> None:
        """Wait for every queued save (tests, shutdown)."""
        self._thread.flush()

    def _store(self, kv: KVBuffer, job: RestoreJob, keys: list[ChunkKey], inputs: torch.Tensor, first: int,
               store: ChunkStore) -> None:
        fingerprint = self.model.fingerprint()
        written = save_chunks(kv, job, store, model_fingerprint=fingerprint, keys=keys)
        if self.stage > 0:
            written += save_boundaries(job, inputs, store, model_fingerprint=fingerprint, keys=keys,
                                       first_row_token=first)
        self.metrics.saved_chunks.inc(len(keys))
        self.metrics.saved_bytes.inc(written)
