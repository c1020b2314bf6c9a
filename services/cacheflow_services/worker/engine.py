"""What a stage worker does, whatever the transport: restore a request's prefix on its layers, run its
layers over new tokens (suffix prefill, decode), store what it computes, release the request.

Per request it keeps a `Session`: the KV buffer from the pool, how many tokens it holds, the token
ids so far (every stage needs them: chunk keys chain over token ids), and this stage's inputs for
tokens not yet stored (a stage's boundary activation *is* its input). Whole chunks are stored as
they fill up, and a prompt's partial last chunk as its own object (its key differs from the whole
chunk's), by a saver thread, off the request's critical path.

Restores take their input from (DESIGN.md §1):
* stage 0: the token embeddings;
* `input="boundary"`: the boundary activations in storage (all stages at once, independently);
* `input="pipelined"`: the previous stage's output, chunk by chunk (`UpstreamInput`); deliveries may
  arrive before this stage's restore call does, so they wait in a mailbox until it comes;
* `input="sequential"`: the same, but each stage sends its output only once it is done (a baseline).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from cacheflow_common.errors import BadRequestError
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.restore.arbiter import LoadArbiter
from cacheflow_common.restore.executor import POLICIES, RestoreJob, RestoreResult, restore
from cacheflow_common.restore.profile import Profile
from cacheflow_common.restore.save import make_job, save_chunks
from cacheflow_common.restore.stages import BoundaryInput, BoundaryMissingError, save_boundaries
from cacheflow_common.restore.upstream import UpstreamInput, restore_from_upstream
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.worker.config import WorkerConfig
from cacheflow_services.worker.metrics import WorkerMetrics
from cacheflow_services.worker.next_stage import DeliverySender, NextStage
from cacheflow_services.worker.pool import KVPool

log = logging.getLogger(__name__)
UPSTREAM_FED = ("pipelined", "sequential")  # restore inputs taken from the previous stage's output
MAILBOX_CHUNKS = 65536  # deliveries held for restores not yet started (bounds memory if one never comes)


class UnknownRequestError(BadRequestError):
    """No session for this request on this stage (HTTP 404)."""


class ConflictError(BadRequestError):
    """The request does not fit this session's state (HTTP 409): wrong position, over its reserve."""


@dataclass
class Session:
    tenant: str
    kv: KVBuffer
    token_ids: list[int]  # every token whose KV is in `kv`, in order
    save: bool  # store whole chunks as they fill up
    saved_tokens: int  # tokens [0, saved_tokens) are in storage (whole chunks, or the restored prefix)
    unsaved_input: torch.Tensor  # [len(token_ids) - saved_tokens, hidden]: this stage's input for them


class StageEngine:
    def __init__(self, config: WorkerConfig, model: Transformer, stores: dict[str, ChunkStore],
                 profile: Profile | None, next_stage: NextStage | None) -> None:
        self.config = config
        self.model = model
        self.layers = config.layers
        self.stores = stores  # tenant -> placement over the storage pods
        self.profile = profile
        self.next_stage = next_stage
        self.metrics = WorkerMetrics()
        self.links = LoadArbiter(len(config.pods))  # the storage links, shared by the requests restoring here
        self.pool = KVPool(model, config.layers, capacity_tokens=config.pool_tokens, block_tokens=config.block_tokens)
        self._sessions: dict[str, Session] = {}
        self._upstreams: dict[str, UpstreamInput] = {}
        self._mailbox: dict[str, list[Callable[[UpstreamInput], None]]] = {}
        self._boundary_bytes: dict[str, int] = {}  # request id -> boundary bytes its restore read
        self._lock = threading.Lock()
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="saver")

    # ------------------------------------------------------------------------------------ restore
    def restore(self, request_id: str, token_ids: list[int], *, tenant: str, input_mode: str,
                reserve_tokens: int, policy: str = "") -> dict[str, Any]:
        """Restore the prefix `token_ids` on this stage's layers; the KV stays for later forwards."""
        store = self._store(tenant)
        self._check_tokens(token_ids, reserve_tokens)
        job = make_job(self.model, token_ids, tenant=tenant, chunk_size=self.config.chunk_size, layers=self.layers)
        self._check_new(request_id)
        kv = self.pool.allocate(request_id, len(token_ids) + reserve_tokens)
        sender = self._sender(request_id, hold=input_mode == "sequential") if input_mode in UPSTREAM_FED else None
        start = time.perf_counter()
        try:
            result = self._run_restore(request_id, job, store, kv, input_mode, sender, policy or self.config.policy)
        except BaseException as exc:
            self.pool.release(request_id)
            if sender is not None:
                sender.fail(f"stage {self.config.stage} failed: {exc}")
            raise
        finally:
            with self._lock:
                self._upstreams.pop(request_id, None)
        if sender is not None:
            sender.finish()
        with self._lock:
            self._sessions[request_id] = Session(tenant=tenant, kv=kv, token_ids=list(token_ids), save=True,
                                                 saved_tokens=len(token_ids),
                                                 unsaved_input=self.model.embed(torch.zeros(0, dtype=torch.long)))
        self._save_recomputed(job, result, store)
        elapsed = time.perf_counter() - start
        self.metrics.restores.labels(input_mode, result.mode).inc()
        self.metrics.restore_seconds.observe(elapsed)
        self._refresh_pool_gauges()
        sources = result.sources()
        return {"stage": self.config.stage, "input": input_mode, "mode": result.mode, "elapsed_s": elapsed,
                "computed": sources.count("computed"), "loaded": sources.count("loaded"),
                "misses": dict(result.misses), "bytes_loaded": result.bytes_loaded,
                "boundary_bytes_read": self._boundary_bytes.pop(request_id, 0)}

    def _run_restore(self, request_id: str, job: RestoreJob, store: ChunkStore, kv: KVBuffer, input_mode: str,
                     sender: DeliverySender | None, policy: str) -> RestoreResult:
        deliver = sender.deliver if sender is not None else None
        if input_mode in UPSTREAM_FED and self.config.stage > 0:
            upstream = self._attach_upstream(request_id, job)
            return restore_from_upstream(job, model=self.model, store=store, upstream=upstream, kv=kv,
                                         on_computed=deliver)
        policy, costs, l_delta = self._policy(policy, token_wise=deliver is not None,
                                              pipeline=self.config.stage > 0 or self.next_stage is not None)
        if self.config.stage == 0:
            return restore(job, model=self.model, store=store, policy=policy, costs=costs, l_delta=l_delta, kv=kv,
                           on_computed=deliver, links=self.links)
        with BoundaryInput(job, store, device=self.model.device) as inputs:
            if missing := inputs.missing():
                raise BoundaryMissingError(f"boundary activations missing for chunks "
                                           f"{missing[:8]}{'...' if len(missing) > 8 else ''}; restore pipelined")
            result = restore(job, model=self.model, store=store, policy=policy, costs=costs, l_delta=l_delta,
                             kv=kv, stage_input=inputs, on_computed=deliver, links=self.links)
        self._boundary_bytes[request_id] = inputs.bytes_read
        return result

    def _policy(self, policy: str, *, token_wise: bool, pipeline: bool) -> tuple[str, Any, int]:
        """`policy`, with its costs; without a profile the CacheFlow ones fall back to Cake's (no costs).

        Adaptive `cacheflow` goes token-wise on every stage of a multi-stage pipeline: a layer-wise
        restore on stage s > 0 reads the whole prefix's boundary activations before its first layer, a
        cost the single-stage profile behind L_delta does not see (bench/results/batch.md measures it),
        and all stages take one mode, as the scheduler and simulator plan a request.
        """
        if policy not in POLICIES:
            raise BadRequestError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
        if policy.startswith("cacheflow") and self.profile is None:
            return "cake", None, 0
        if token_wise and policy in ("cacheflow", "cacheflow-layer"):
            policy = "cacheflow-token"  # the next stage consumes our chunks as they are computed
        if pipeline and policy == "cacheflow":
            policy = "cacheflow-token"
        if self.profile is None:
            return policy, None, 0
        return policy, self.profile.cost_model(None), self.profile.l_delta_for(None)

    def _sender(self, request_id: str, *, hold: bool) -> DeliverySender | None:
        return None if self.next_stage is None else DeliverySender(self.next_stage, request_id, hold=hold)

    def _save_recomputed(self, job: RestoreJob, result: RestoreResult, store: ChunkStore) -> None:
        """Store again the chunks a restore recomputed because their load missed."""
        missed = [i for i, u in enumerate(result.units) if u.miss_reason]
        if not missed:
            return
        keys = [job.keys[i] for i in missed] if result.mode == "token" else list(job.keys)
        self._saver.submit(self._guarded, save_chunks, result.kv, job, store,
                           model_fingerprint=self.model.fingerprint(), keys=keys)

    # ------------------------------------------------------------------------------------ pipelined input
    def deliver(self, request_id: str, index: int, hidden: torch.Tensor) -> None:
        """The previous stage's output for chunk `index` of a pipelined restore."""
        self._to_upstream(request_id, lambda up: up.deliver(index, hidden.to(self.model.device)))

    def finish_upstream(self, request_id: str, failure: str) -> None:
        self._to_upstream(request_id, (lambda up: up.fail(failure)) if failure else (lambda up: up.finish()))

    def _to_upstream(self, request_id: str, event: Callable[[UpstreamInput], None]) -> None:
        with self._lock:
            upstream = self._upstreams.get(request_id)
            if upstream is None:
                if sum(len(v) for v in self._mailbox.values()) >= MAILBOX_CHUNKS:
                    raise ConflictError("too many deliveries for restores that have not started")
                self._mailbox.setdefault(request_id, []).append(event)
                return
        event(upstream)

    def _attach_upstream(self, request_id: str, job: RestoreJob) -> UpstreamInput:
        upstream = UpstreamInput(job, timeout_s=self.config.upstream_timeout_s)
        with self._lock:
            self._upstreams[request_id] = upstream
            early = self._mailbox.pop(request_id, [])
        for event in early:
            event(upstream)
        return upstream

    # ------------------------------------------------------------------------------------ forward
    def forward(self, meta: dict[str, Any], hidden: torch.Tensor | None) -> dict[str, Any]:
        """Run this stage's layers over new tokens of a request, then the next stage's (or sample)."""
        request_id, start, token_ids = meta["request_id"], meta["start"], meta["token_ids"]
        session = self._session_for(meta)
        if start != len(session.token_ids):
            raise ConflictError(f"request {request_id!r} holds {len(session.token_ids)} tokens, not {start}")
        if start + len(token_ids) > session.kv.capacity:
            raise ConflictError(f"request {request_id!r} would exceed its reserved {session.kv.capacity} tokens")
        x = self._stage_input(token_ids, hidden)  # [T, hidden]
        out = self.model.forward_layers(x, self.layers, [Span(session.kv, start, len(token_ids))])  # [T, hidden]
        session.token_ids.extend(token_ids)
        if session.save and self.config.stage > 0:  # stage 0's input is the embedding: never stored
            session.unsaved_input = torch.cat([session.unsaved_input, x])
        self.metrics.forward_tokens.inc(len(token_ids))
        if session.save:
            self._save_filled(session)
            if len(token_ids) > 1:  # a prompt's prefill: its partial last chunk too, so it restores whole
                self._save_tail(session)
        if self.next_stage is None:
            return {"token": sample(self.model.logits(out[-1:])[0], meta.get("temperature", 0.0),
                                    meta.get("seed", 0), position=start + len(token_ids))}
        return self.next_stage.forward(meta, out)

    def _session_for(self, meta: dict[str, Any]) -> Session:
        request_id = meta["request_id"]
        with self._lock:
            session = self._sessions.get(request_id)
        if session is not None:
            return session
        if meta["start"] != 0:
            raise UnknownRequestError(f"request {request_id!r} has no KV on stage {self.config.stage}")
        self._store(meta["tenant"])  # an unknown tenant is refused before anything is allocated
        reserve = meta.get("reserve_tokens", 0)
        self._check_tokens(meta["token_ids"], reserve)
        self._check_new(request_id)
        kv = self.pool.allocate(request_id, len(meta["token_ids"]) + reserve)
        session = Session(tenant=meta["tenant"], kv=kv, token_ids=[], save=bool(meta.get("save", True)),
                          saved_tokens=0, unsaved_input=self.model.embed(torch.zeros(0, dtype=torch.long)))
        with self._lock:
            self._sessions[request_id] = session
        self._refresh_pool_gauges()
        return session

    def _stage_input(self, token_ids: list[int], hidden: torch.Tensor | None) -> torch.Tensor:
        if self.config.stage == 0:
            self._check_tokens(token_ids, 0)
            return self.model.embed(torch.tensor(token_ids, dtype=torch.long))  # [T, hidden]
        expected = (len(token_ids), self.model.config.hidden_size)
        if hidden is None or tuple(hidden.shape) != expected:
            raise BadRequestError(f"stage {self.config.stage} needs hidden states of shape {expected}")
        return hidden.to(self.model.device, self.model.dtype)

    def _save_filled(self, session: Session) -> None:
        """Queue the whole chunks that filled up since the last save: KV, and the boundary (stage > 0)."""
        size = self.config.chunk_size
        whole = len(session.token_ids) // size * size
        if whole <= session.saved_tokens:
            return
        job = make_job(self.model, session.token_ids[:whole], tenant=session.tenant, chunk_size=size,
                       layers=self.layers)
        keys = [k for k in job.keys if k.token_start >= session.saved_tokens]
        inputs, first = session.unsaved_input, session.saved_tokens
        session.unsaved_input = inputs[whole - first :]
        session.saved_tokens = whole
        self._saver.submit(self._guarded, self._store_chunks, session.kv, job, keys, inputs, first,
                           self._store(session.tenant))

    def _save_tail(self, session: Session) -> None:
        """Queue the partial last chunk (KV and boundary) as its own object; whole chunks still come later."""
        if len(session.token_ids) == session.saved_tokens:
            return
        job = make_job(self.model, session.token_ids, tenant=session.tenant, chunk_size=self.config.chunk_size,
                       layers=self.layers)
        tail = job.keys[-1]
        if tail.token_start != session.saved_tokens:  # a restored prefix ended mid-chunk: its inputs are gone
            return
        self._saver.submit(self._guarded, self._store_chunks, session.kv, job, [tail], session.unsaved_input,
                           session.saved_tokens, self._store(session.tenant))

    def _store_chunks(self, kv: KVBuffer, job: RestoreJob, keys: list[Any], inputs: torch.Tensor, first: int,
                      store: ChunkStore) -> None:
        fingerprint = self.model.fingerprint()
        written = save_chunks(kv, job, store, model_fingerprint=fingerprint, keys=keys)
        if self.config.stage > 0:
            written += save_boundaries(job, inputs, store, model_fingerprint=fingerprint, keys=keys,
                                       first_row_token=first)
        self.metrics.saved_chunks.inc(len(keys))
        self.metrics.saved_bytes.inc(written)

    def _guarded(self, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Saves run off the critical path: a failure is logged and counted (the chunk is recomputed later)."""
        try:
            fn(*args, **kwargs)
        except Exception:
            log.exception("saving chunks failed")
            self.metrics.save_failures.inc()

    # ------------------------------------------------------------------------------------ housekeeping
    def release(self, request_id: str) -> bool:
        with self._lock:
            self._sessions.pop(request_id, None)
            self._mailbox.pop(request_id, None)
        released = self.pool.release(request_id)
        self._refresh_pool_gauges()
        return released

    def kv_of(self, request_id: str) -> torch.Tensor:
        """[L_s, 2, Hkv, tokens, D]: the KV this stage holds for the request's tokens so far."""
        with self._lock:
            session = self._sessions.get(request_id)
        if session is None:
            raise UnknownRequestError(f"request {request_id!r} has no KV on stage {self.config.stage}")
        return session.kv.data[:, :, :, : len(session.token_ids)]

    def flush(self) -> None:
        """Wait for every queued save (tests, shutdown)."""
        self._saver.submit(lambda: None).result()

    def _store(self, tenant: str) -> ChunkStore:
        store = self.stores.get(tenant)
        if store is None:
            raise BadRequestError(f"tenant {tenant!r} is not configured on this worker")
        return store

    def _check_new(self, request_id: str) -> None:
        if self.pool.get(request_id) is not None:
            raise ConflictError(f"request {request_id!r} already holds KV on stage {self.config.stage}")

    def _check_tokens(self, token_ids: list[int], reserve: int) -> None:
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise BadRequestError(f"token ids must be in [0, {vocab})")
        if reserve < 0 or len(token_ids) + reserve > self.config.max_request_tokens:
            raise BadRequestError(f"{len(token_ids)} tokens + {reserve} reserved exceed the limit of "
                                  f"{self.config.max_request_tokens} per request")

    def _refresh_pool_gauges(self) -> None:
        self.metrics.pool_used_blocks.set(self.pool.used_blocks)
        self.metrics.requests.set(self.pool.requests())


def sample(logits: torch.Tensor, temperature: float, seed: int, *, position: int) -> int:
    """The next token from logits [vocab]: greedy at temperature 0, else sampled reproducibly (seed, position)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + position)
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)  # [vocab]
    return int(torch.multinomial(probs, 1, generator=generator))
