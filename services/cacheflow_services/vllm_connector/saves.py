"""Storing what vLLM computed (and what a restore recomputed), on one saver thread off vLLM's forward
thread, with the keys and chunk format the stage workers use. A failed save is logged and counted; the
chunk is recomputed by a later restore.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cacheflow_common.kv.keys import ChunkKey, HeadRange, chunk_keys, tenant_salt
from cacheflow_common.restore.boundary import save_boundaries
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.save import dtype_name, put_chunk
from cacheflow_common.restore.saver_thread import SaverThread
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.vllm_connector.draft_kv import DraftCaches
from cacheflow_services.vllm_connector.model_identity import salted
from cacheflow_services.vllm_connector.plan import SaveSpec
from cacheflow_services.vllm_connector.ranks import ONE_RANK, RowShare
from cacheflow_services.vllm_connector.runtime import Event


class ConnectorSaves:
    def __init__(self, store: ChunkStore, event: Event, *, fingerprint: str, dtype: torch.dtype, kv_dtype: str,
                 chunk_size: int, tenant: str, heads: HeadRange | None = None, row_share: RowShare = ONE_RANK
                 ) -> None:
        """`dtype`: the model's (boundary activations); `kv_dtype`: the chunks' (the cache's, fp8 included);
        `heads`: the model's KV heads the chunks hold (a tensor-parallel rank's; None: all); `row_share`: the
        chunks whose captured rows this rank stores (every rank captures the same rows)."""
        self.store = store
        self.event = event
        self.fingerprint = fingerprint
        self.dtype = dtype
        self.kv_dtype = kv_dtype
        self.chunk_size = chunk_size
        self.tenant = tenant
        self.heads = heads
        self.row_share = row_share
        self._thread = SaverThread("cacheflow-saver", lambda request_id, exc: event(
            "save_error", req=request_id, error=f"{type(exc).__name__}: {exc}"))

    def store_new(self, spec: SaveSpec, kv: torch.Tensor, hidden: torch.Tensor | None, layers: range, *,
                  captured: Sequence[tuple[int, str]] | None = None,
                  draft: tuple[torch.Tensor, DraftCaches] | None = None) -> None:
        """Queue the spec's chunks [start, end): kv [b - a, 2, Hkv, T, D] for this rank's layers, and (a rank
        that captures rows) hidden [T, k * hidden], k tensors side by side, each stored as `captured`'s (layer,
        kind) says: the boundary activations entering its first layer, the model's output rows
        (boundary.OUTPUT_KIND), an EAGLE-3 draft's auxiliary layers' (draft.py); and `draft`: the draft's KV of
        those positions, [Ld, 2, Hkv, T, D], and its caches (draft_kv.py)."""
        self._thread.submit(spec.req_id, lambda: self._store_new(spec, kv, hidden, layers, captured, draft))

    def store_again(self, request_id: str, chunks: list[tuple[ChunkKey, torch.Tensor]], job: RestoreJob, *,
                    salt: str) -> None:
        """Queue chunks a restore recomputed because their load missed, each (key, its KV [L, 2, Hkv, C, D] for
        the job's layers); `salt`: the request's, as its keys'."""
        fingerprint = salted(self.fingerprint, salt)
        self._thread.submit(request_id, lambda: [self._put(key, job.token_ids, kv, job.layers, fingerprint)
                                                 for key, kv in chunks])

    def flush(self) -> None:
        """Wait for every queued save."""
        self._thread.flush()

    def close(self) -> None:
        self._thread.close()

    def _store_new(self, spec: SaveSpec, kv: torch.Tensor, hidden: torch.Tensor | None, layers: range,
                   captured: Sequence[tuple[int, str]] | None, draft: tuple[torch.Tensor, DraftCaches] | None
                   ) -> None:
        fingerprint = salted(self.fingerprint, spec.salt)
        every = tuple(chunk_keys(spec.token_ids, self.chunk_size, tenant_salt(fingerprint, self.tenant)))
        keys = [k for k in every if k.token_start >= spec.start]
        first = spec.start  # kv's first position
        written = sum(self._put(key, spec.token_ids, kv[:, :, :, key.token_start - first : key.token_end - first],
                                layers, fingerprint) for key in keys)  # each chunk's [b - a, 2, Hkv, C, D]
        if captured and hidden is None:  # these chunks cannot be restored: vLLM recomputes them
            self.event("boundary_missing", req=spec.req_id, chunks=len(keys), layer=captured[0][0])
        elif hidden is not None and captured:
            for (layer, kind), rows in zip(captured, hidden.chunk(len(captured), dim=-1), strict=True):
                job = RestoreJob(token_ids=spec.token_ids, keys=every, layers=range(layer, layer + 1),
                                 kv_dtype=dtype_name(self.dtype))
                written += save_boundaries(job, rows.to(self.dtype), self.store, model_fingerprint=fingerprint,
                                           keys=[k for k in keys if self.row_share.mine(k.index)],
                                           first_row_token=spec.start, kind=kind)
        self.event("save", req=spec.req_id, chunks=len(keys), bytes=written, tokens_end=len(spec.token_ids))
        if draft is not None:
            draft_kv, caches = draft
            draft_bytes = caches.store(self.store, keys, spec.token_ids, spec.next_token, draft_kv, first,
                                       fingerprint=fingerprint)
            self.event("draft_save", req=spec.req_id, chunks=len(keys), bytes=draft_bytes)

    def _put(self, key: ChunkKey, token_ids: tuple[int, ...], kv: torch.Tensor, layers: range, fingerprint: str
             ) -> int:
        """Store one chunk: kv [b - a, 2, Hkv, C, D], its layers' KV in the cache's dtype; the bytes written."""
        return put_chunk(self.store, key, token_ids, kv, model_fingerprint=fingerprint, layers=layers,
                         dtype=self.kv_dtype, heads=self.heads)
