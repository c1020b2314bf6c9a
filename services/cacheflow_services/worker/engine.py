"""What a stage worker does, whatever the transport (docs/architecture.md, "The stage worker").

A request's life here, in this class's order: admitted (KV from the pool) by a `restore` or by its
first `forward` → restored → forward* → `release`. Everything the stage holds for it is one
`StageRequest` record in the engine's one map (`Engine.requests`), its pool grant and (while it restores)
the engine's restore among its fields; admission and release are one call each there. The restore itself,
and every forward pass, run in the stage's `Engine` (`cacheflow_common.engine`): one compute loop
with one batched forward per step across all requests, and one loader per storage pod.

Restores take their input from: stage 0, the token embeddings; `input="boundary"`, the boundary
activations in storage (all stages at once, independently); `input="pipelined"`, the previous
stage's output chunk by chunk (deliveries may arrive before this stage's restore call does, so they
wait in the request's mailbox); `input="sequential"`, the same, sent only once the previous stage is done.
Whole chunks are stored as they fill up, and a prompt's partial last chunk as its own object, by a saver
thread, off the critical path (`saving.ChunkSaver`).

Trust (`trust.py`): the HTTP layer checks the coordinator's grant before it calls in here; the engine
keeps a request to the tenant that created it, stores chunks only for requests allowed to save, takes
deliveries only under a delivery grant for the request's tokens, and frees a request nobody has used
for `hold_ttl_s` (a coordinator that died or forgot it), a mailbox once its grant expired.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from cacheflow_common.auth import Grant
from cacheflow_common.engine import (
    UPSTREAM_FED,
    ConflictError,
    Engine,
    ForwardItem,
    KVPool,
    RequestTable,
    StageRequest,
    StepPlan,
)
from cacheflow_common.errors import BadRequestError, GrantError
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.profile import Profile
from cacheflow_common.restore.save import make_job
from cacheflow_common.restore.upstream import UpstreamInput
from cacheflow_common.stage_api import ForwardAnswer, ForwardMeta, RestoreSummary
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.worker.config import WorkerConfig, engine_settings
from cacheflow_services.worker.metrics import WorkerMetrics
from cacheflow_services.worker.next_stage import DeliverySender, NextStage
from cacheflow_services.worker.saving import ChunkSaver
from cacheflow_services.worker.trust import SpentGrants

log = logging.getLogger(__name__)

__all__ = ["ConflictError", "StageEngine", "UnknownRequestError", "sample"]


class UnknownRequestError(BadRequestError):
    """No such request on this stage (HTTP 404)."""


class StageEngine:
    def __init__(self, config: WorkerConfig, model: Transformer, stores: Mapping[str, ChunkStore],
                 profile: Profile | None, next_stage: NextStage | None, *, spent: SpentGrants | None = None) -> None:
        self.config = config
        self.model = model
        self.stores = stores  # tenant -> placement over the storage pods (GrantedStores on a served worker)
        self.next_stage = next_stage
        self.metrics = WorkerMetrics(n_channels=len(config.pods))
        self.pool = KVPool(model, config.layers, capacity_tokens=config.pool_tokens, block_tokens=config.block_tokens,
                           tenant_share=config.tenant_pool_share)
        self.saver = ChunkSaver(model, stage=config.stage, layers=config.layers, chunk_size=config.chunk_size,
                                metrics=self.metrics)
        self.engine = Engine.for_stage(engine_settings(config, profile), model, sampler=sample,
                                       on_step=self._step_ran, on_load=self.metrics.channel_busy, pool=self.pool,
                                       on_stream_closed=(spent if spent is not None else SpentGrants()).close)
        self.requests: RequestTable = self.engine.requests
        self._closed = threading.Event()
        threading.Thread(target=self._reap_idle, name=f"stage-{config.stage}-reaper", daemon=True).start()

    def _step_ran(self, plan: StepPlan, seconds: float) -> None:
        restored = sum(self.engine.unit_tokens(t.request_id, t.unit) for t in plan.token_units)
        self.metrics.step(seconds, tokens=plan.tokens + restored, requests=len(plan.request_ids()))

    # ------------------------------------------------------------------------------------ admit + restore
    def restore(self, request_id: str, token_ids: list[int], *, tenant: str, input_mode: str,
                reserve_tokens: int, policy: str = "", waited_s: float = 0.0, save: bool = True,
                max_tokens: int | None = None, digest: str = "", deliver_grant: str = "") -> RestoreSummary:
        """Restore the prefix `token_ids` on this stage's layers; the KV stays for later forwards. `save`:
        whether the request may store chunks (recomputed misses now, its new chunks later); `max_tokens`:
        the most tokens its grant lets it hold here; `digest`: its grant's digest of the tokens (deliveries
        must have come under a grant with the same); `deliver_grant`: for its deliveries to the next stage."""
        request = self._admit(request_id, tenant, token_ids, reserve_tokens, save=save, max_tokens=max_tokens,
                              restoring=True, digest=digest)
        job = make_job(self.model, token_ids, tenant=tenant, chunk_size=self.config.chunk_size,
                       layers=self.config.layers)
        log.info("restore %s admitted on stage %d: %d prefix tokens, input %s", request_id, self.config.stage,
                 len(token_ids), input_mode)
        sender = (DeliverySender(self.next_stage, request_id, deliver_grant, hold=input_mode == "sequential")
                  if input_mode in UPSTREAM_FED and self.next_stage is not None else None)
        assert request.kv is not None  # admitted
        try:
            restore = self.engine.submit(
                request_id, job, tenant_store(self.stores, tenant), request.kv, policy=policy or self.config.policy,
                input_mode=input_mode, arrival_s=time.perf_counter() - waited_s,
                inputs=self._upstream(request_id, job) if input_mode in UPSTREAM_FED and self.config.stage else None,
                on_computed=sender.deliver if sender is not None else None)
            summary = restore.done.result()
        except BaseException as exc:
            log.warning("restore %s failed on stage %d: %s: %s", request_id, self.config.stage, type(exc).__name__, exc)
            self.release(request_id, quiet=True)
            if sender is not None:
                sender.fail(f"stage {self.config.stage} failed: {exc}")
            raise
        finally:
            self.requests.detach(request_id)
        if sender is not None:
            sender.finish()
        request.token_ids, request.saved_tokens, request.restoring = list(token_ids), len(token_ids), False
        request.touched = time.monotonic()
        if save:
            self.saver.save_recomputed(job, restore, tenant_store(self.stores, tenant))
        log.info("restore %s finished on stage %d: %d units loaded, %d computed (%s-wise), %.3f s", request_id,
                 self.config.stage, summary.loaded, summary.computed, summary.mode, summary.elapsed_s)
        self.metrics.restores.labels(input_mode, summary.mode).inc()
        self.metrics.restore_seconds.observe(summary.elapsed_s)
        return summary

    def _admit(self, request_id: str, tenant: str, token_ids: list[int], reserve_tokens: int, *, save: bool,
               max_tokens: int | None, restoring: bool, digest: str = "") -> StageRequest:
        """Check a new request and give it its KV from the pool (an unknown tenant is refused first)."""
        tenant_store(self.stores, tenant)
        _check_tokens(self.model, self.config, token_ids, reserve_tokens)
        if max_tokens is not None and len(token_ids) + reserve_tokens > max_tokens:
            raise GrantError(f"{len(token_ids) + reserve_tokens} tokens asked; the coordinator granted at most "
                             f"{max_tokens}")
        request = StageRequest(request_id, tenant=tenant, save=save, restoring=restoring, digest=digest,
                               unsaved_input=self.model.embed(torch.zeros(0, dtype=torch.long)))  # [0, hidden]
        self.requests.admit(request, len(token_ids) + reserve_tokens)
        self.metrics.pool_changed(self.pool.used_blocks, self.pool.requests())
        return request

    # ------------------------------------------------------------------------------------ pipelined input
    def deliver(self, grant: Grant, index: int, hidden: torch.Tensor) -> None:
        """The previous stage's output for chunk `index` of a pipelined restore, under the delivery `grant`."""
        if hidden.dim() != 2 or hidden.shape[1] != self.model.config.hidden_size:
            raise BadRequestError(f"a delivery's hidden states are [tokens, {self.model.config.hidden_size}]")
        max_bytes = grant.max_tokens * self.model.config.hidden_size * 4  # float32 rows, at most
        self.requests.deliver(grant, lambda up: up.deliver(index, hidden.to(self.model.device)),
                              rows=hidden.shape[0], nbytes=hidden.nbytes, max_bytes=max_bytes)

    def finish_upstream(self, grant: Grant, failure: str) -> None:
        self.requests.deliver(grant, (lambda up: up.fail(failure)) if failure else (lambda up: up.finish()))

    def _upstream(self, request_id: str, job: RestoreJob) -> UpstreamInput:
        upstream = UpstreamInput(job, timeout_s=self.config.upstream_timeout_s)
        self.requests.attach(request_id, upstream)
        return upstream

    # ------------------------------------------------------------------------------------ forward
    def forward(self, meta: ForwardMeta, hidden: torch.Tensor | None, *,
                max_tokens: int | None = None, grant: str = "") -> ForwardAnswer:
        """Run this stage's layers over new tokens of a request (in the engine's next steps), then the
        next stage's (or sample the next token). `max_tokens`: what its grant lets a new request hold;
        `grant`: the grant, relayed to the next stage."""
        request = self._forwarded(meta, max_tokens)
        if not meta.save:  # a restored request is told only now whether to store what comes
            request.save = False
        if meta.start != len(request.token_ids):
            raise ConflictError(f"request {meta.request_id!r} holds {len(request.token_ids)} tokens, not {meta.start}")
        assert request.kv is not None and request.unsaved_input is not None  # admitted
        if meta.start + len(meta.token_ids) > request.kv.capacity:
            raise ConflictError(f"request {meta.request_id!r} would exceed its reserved {request.kv.capacity} tokens")
        x = _stage_input(self.model, self.config, meta.token_ids, hidden)  # [T, hidden]
        sample_with = (meta.temperature, meta.seed) if self.next_stage is None else None
        out = self.engine.forward(ForwardItem(request_id=meta.request_id, kv=request.kv, start=meta.start, rows=x,
                                              sample=sample_with))
        request.token_ids.extend(meta.token_ids)
        if request.save and self.config.stage > 0:  # stage 0's input is the embedding: never stored
            request.unsaved_input = torch.cat([request.unsaved_input, x])
        self.metrics.forward_tokens.inc(len(meta.token_ids))
        if request.save:
            store = tenant_store(self.stores, request.tenant)
            self.saver.save_filled(request, store)
            if len(meta.token_ids) > 1:  # a prompt's prefill: its partial last chunk too, so it restores whole
                self.saver.save_tail(request, store)
        if isinstance(out, int):
            return ForwardAnswer(token=out)
        assert self.next_stage is not None  # only the last stage samples
        return self.next_stage.forward(meta, out, grant)

    def _forwarded(self, meta: ForwardMeta, max_tokens: int | None) -> StageRequest:
        """The request a forward continues (its own tenant's, restored), or a new one opened by it at 0."""
        request = self.requests.get(meta.request_id)
        if request is not None and request.kv is not None:
            if request.tenant != meta.tenant:
                raise GrantError(f"request {meta.request_id!r} belongs to another tenant")
            if request.restoring:
                raise ConflictError(f"request {meta.request_id!r} is still restoring on stage {self.config.stage}")
            request.touched = time.monotonic()
            return request
        if meta.start != 0:
            raise UnknownRequestError(f"request {meta.request_id!r} has no KV on stage {self.config.stage}")
        request = self._admit(meta.request_id, meta.tenant, meta.token_ids, meta.reserve_tokens, save=meta.save,
                              max_tokens=max_tokens, restoring=False)
        log.info("request %s opened on stage %d: %d tokens, %d reserved, save %s", meta.request_id,
                 self.config.stage, len(meta.token_ids), meta.reserve_tokens, meta.save)
        return request

    # ------------------------------------------------------------------------------------ release
    def release(self, request_id: str, *, quiet: bool = False, tenant: str | None = None) -> bool:
        """Free everything the stage holds for a request; a restore still running for it stops (its caller
        gets an error). `quiet`: a restore that failed frees its own KV (logged by its caller); `tenant`:
        the caller's, which must be the request's."""
        if tenant is not None:
            self._owned(request_id, tenant)
        request = self.requests.release(request_id)
        released = request is not None and request.grant is not None
        self.metrics.pool_changed(self.pool.used_blocks, self.pool.requests())
        if released and not quiet:
            log.info("request %s released on stage %d", request_id, self.config.stage)
        return released

    def _reap_idle(self) -> None:
        """Free every request idle longer than `hold_ttl_s`: no hold outlives the coordinator's use of it."""
        ttl = self.config.hold_ttl_s
        while not self._closed.wait(min(ttl / 4, 5.0)):
            for request_id in self.requests.idle(ttl):
                request = self.requests.get(request_id)
                if request is not None and request.restoring:
                    continue  # a restore in progress is bounded by its own timeouts
                log.warning("request %s held KV on stage %d unused for over %.0f s: freed", request_id,
                            self.config.stage, ttl)
                self.release(request_id)

    # ------------------------------------------------------------------------------------ reads
    def kv_of(self, request_id: str, *, tenant: str | None = None) -> torch.Tensor:
        """[L_s, 2, Hkv, tokens, D]: the KV this stage holds for the request's tokens so far (`tenant`: the
        caller's, which must be the request's)."""
        request = self._owned(request_id, tenant) if tenant is not None else self.requests.get(request_id)
        if request is None or request.kv is None or request.restoring:
            raise UnknownRequestError(f"request {request_id!r} has no KV on stage {self.config.stage}")
        return request.kv.data[:, :, :, : len(request.token_ids)]

    def _owned(self, request_id: str, tenant: str) -> StageRequest | None:
        """The request, if any; GrantError when it belongs to another tenant than `tenant`."""
        request = self.requests.get(request_id)
        if request is not None and request.tenant and request.tenant != tenant:
            raise GrantError(f"request {request_id!r} belongs to another tenant")
        return request

    def can_admit_typical(self) -> bool:
        """Whether the pool has room for a typical request now (`/readyz`)."""
        return self.pool.free_blocks >= self.pool.blocks_for(self.config.typical_request_tokens)

    def busy(self) -> dict[str, Any]:
        """Seconds the compute loop and each channel have been busy since start (utilisation = rate)."""
        return self.metrics.busy_totals()

    def flush(self) -> None:
        """Wait for every queued save (tests, shutdown)."""
        self.saver.flush()

    def close(self) -> None:
        """Stop the engine (requests in flight get no answer), after queued saves."""
        self._closed.set()
        self.engine.close()
        self.flush()


def tenant_store(stores: Mapping[str, ChunkStore], tenant: str) -> ChunkStore:
    store = stores.get(tenant)
    if store is None:
        raise BadRequestError(f"tenant {tenant!r} is not configured on this worker")
    return store


def _stage_input(model: Transformer, config: WorkerConfig, token_ids: list[int],
                 hidden: torch.Tensor | None) -> torch.Tensor:
    """This stage's input for new tokens, [T, hidden]: their embeddings (stage 0), or the hidden states sent."""
    if config.stage == 0:
        _check_tokens(model, config, token_ids, 0)
        return model.embed(torch.tensor(token_ids, dtype=torch.long))  # [T, hidden]
    expected = (len(token_ids), model.config.hidden_size)
    if hidden is None or tuple(hidden.shape) != expected:
        raise BadRequestError(f"stage {config.stage} needs hidden states of shape {expected}")
    return hidden.to(model.device, model.dtype)


def _check_tokens(model: Transformer, config: WorkerConfig, token_ids: list[int], reserve: int) -> None:
    vocab = model.config.vocab_size
    if any(not 0 <= t < vocab for t in token_ids):
        raise BadRequestError(f"token ids must be in [0, {vocab})")
    if reserve < 0 or len(token_ids) + reserve > config.max_request_tokens:
        raise BadRequestError(f"{len(token_ids)} tokens + {reserve} reserved exceed the limit of "
                              f"{config.max_request_tokens} per request")


def sample(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """The next token from logits [vocab]: greedy at temperature 0, else sampled reproducibly (seed, position)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + position)
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)  # [vocab]
    return int(torch.multinomial(probs, 1, generator=generator))
