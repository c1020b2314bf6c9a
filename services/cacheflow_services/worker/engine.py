"""What a stage worker does, whatever the transport: one engine per stage (docs/architecture.md, "The
stage engine").

* One compute loop owns the model (`step_loop.StepLoop`): every step runs one batched forward over
  what the batch scheduler picked across all requests on this stage — restore units, suffix-prefill
  slices, decode tokens — within a token budget.
* One loader per storage channel (`channels.ChannelLoader`) asks the scheduler what to load next.
* Request threads (the HTTP handlers) only check, admit and wait: `restore` hands the loop a
  `StageRestore` and waits for its answer; `forward` queues its tokens and waits for their rows.

Per request it keeps a `Session`: the KV buffer from the pool, how many tokens it holds, the token
ids so far (chunk keys chain over token ids), and this stage's inputs for tokens not yet stored (a
stage's boundary activation *is* its input). Whole chunks are stored as they fill up, and a prompt's
partial last chunk as its own object, by a saver thread, off the critical path.

Trust (`trust.py`): the HTTP layer checks the coordinator's grant before it calls in here; the engine
keeps a session to the tenant that created it, stores chunks only for sessions allowed to save, and
frees a session nobody has used for `hold_ttl_s` (a coordinator that died or forgot it).

Restores take their input from: stage 0, the token embeddings; `input="boundary"`, the boundary
activations in storage (all stages at once, independently); `input="pipelined"`, the previous
stage's output chunk by chunk (deliveries may arrive before this stage's restore call does, so they
wait in a mailbox); `input="sequential"`, the same, sent only once the previous stage is done.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from cacheflow_common.errors import BadRequestError, GrantError
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.executor import RestoreJob
from cacheflow_common.restore.profile import Profile
from cacheflow_common.restore.save import make_job, save_chunks
from cacheflow_common.restore.stages import save_boundaries
from cacheflow_common.restore.upstream import UpstreamInput
from cacheflow_common.sched.policies import make_policy
from cacheflow_common.stage_api import ForwardAnswer, ForwardMeta, RestoreSummary
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.worker.channels import ChannelLoader
from cacheflow_services.worker.config import WorkerConfig
from cacheflow_services.worker.core import EngineCore, ForwardItem, RestoreCancelledError
from cacheflow_services.worker.metrics import WorkerMetrics
from cacheflow_services.worker.next_stage import DeliverySender, NextStage
from cacheflow_services.worker.pool import KVPool
from cacheflow_services.worker.restore_builder import UPSTREAM_FED, RestoreBuilder
from cacheflow_services.worker.stage_restore import StageRestore
from cacheflow_services.worker.step_loop import StepLoop, StepPlan

log = logging.getLogger(__name__)
MAILBOX_CHUNKS = 65536  # deliveries held for restores not yet started (bounds memory if one never comes)


class UnknownRequestError(BadRequestError):
    """No session for this request on this stage (HTTP 404)."""


class ConflictError(BadRequestError):
    """The request does not fit this session's state (HTTP 409): wrong position, over its reserve."""


@dataclass
class Session:
    request_id: str
    tenant: str
    kv: KVBuffer
    token_ids: list[int]  # every token whose KV is in `kv`, in order
    save: bool  # store whole chunks as they fill up
    saved_tokens: int  # tokens [0, saved_tokens) are in storage (whole chunks, or the restored prefix)
    unsaved_input: torch.Tensor  # [len(token_ids) - saved_tokens, hidden]: this stage's input for them
    touched: float = 0.0  # monotonic time of its last restore or forward (idle past hold_ttl_s: freed)


class StageEngine:
    def __init__(self, config: WorkerConfig, model: Transformer, stores: Mapping[str, ChunkStore],
                 profile: Profile | None, next_stage: NextStage | None) -> None:
        self.config = config
        self.model = model
        self.layers = config.layers
        self.stores = stores  # tenant -> placement over the storage pods (GrantedStores on a served worker)
        self.next_stage = next_stage
        self.metrics = WorkerMetrics(n_channels=len(config.pods))
        self.pool = KVPool(model, config.layers, capacity_tokens=config.pool_tokens, block_tokens=config.block_tokens,
                           tenant_share=config.tenant_pool_share)
        self.core = EngineCore(make_policy(config.policy), stage=config.stage)
        self.builder = RestoreBuilder(config, model, profile, on_input=self.core.wake)
        self._sessions: dict[str, Session] = {}
        self._upstreams: dict[str, UpstreamInput] = {}
        self._mailbox: dict[str, list[Callable[[UpstreamInput], None]]] = {}
        self._lock = threading.Lock()
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="saver")
        self.loop = StepLoop(self.core, model, config.layers, step_tokens=config.step_tokens,
                             beside_forward_tokens=config.beside_forward_tokens, sampler=sample, on_step=self._stepped)
        self._loop_thread = threading.Thread(target=self.loop.run, name=f"stage-{config.stage}-loop", daemon=True)
        self._loop_thread.start()
        self._channels = [ChannelLoader(self.core, c, on_load=self.metrics.channel_busy).start()
                          for c in range(len(config.pods))]
        self._closed = threading.Event()
        threading.Thread(target=self._reap_idle, name=f"stage-{config.stage}-reaper", daemon=True).start()

    def close(self) -> None:
        """Stop the loop and the channels (requests in flight get no answer), after queued saves."""
        self._closed.set()
        with self.core.cond:
            self.core.stopped = True
            self.core.cond.notify_all()
        self._loop_thread.join(timeout=10)
        for channel in self._channels:
            channel.join(timeout=10)
        self.flush()

    # ------------------------------------------------------------------------------------ restore
    def restore(self, request_id: str, token_ids: list[int], *, tenant: str, input_mode: str,
                reserve_tokens: int, policy: str = "", waited_s: float = 0.0, save: bool = True,
                max_tokens: int | None = None) -> RestoreSummary:
        """Restore the prefix `token_ids` on this stage's layers; the KV stays for later forwards. `save`:
        whether the request may store chunks (recomputed misses now, its new chunks later); `max_tokens`:
        the most tokens its grant lets it hold here."""
        store = self._store(tenant)
        self._check_tokens(token_ids, reserve_tokens)
        _check_granted(len(token_ids) + reserve_tokens, max_tokens)
        job = make_job(self.model, token_ids, tenant=tenant, chunk_size=self.config.chunk_size, layers=self.layers)
        self._check_new(request_id)
        upstream_fed = input_mode in UPSTREAM_FED and self.config.stage > 0
        kv = self.pool.allocate(request_id, len(token_ids) + reserve_tokens, tenant=tenant)
        log.info("restore %s admitted on stage %d: %d prefix tokens, input %s", request_id, self.config.stage,
                 len(token_ids), input_mode)
        sender = self._sender(request_id, hold=input_mode == "sequential") if input_mode in UPSTREAM_FED else None
        try:
            inputs = self._attach_upstream(request_id, job) if upstream_fed else None
            restore = self.builder.build(request_id, job, store, kv, policy or self.config.policy,
                                         input_mode=input_mode, upstream=inputs,
                                         on_computed=sender.deliver if sender is not None else None,
                                         arrival_s=time.perf_counter() - waited_s)
            self.core.admit(restore)
            summary = restore.done.result()
        except BaseException as exc:
            self._abandon(request_id)
            if sender is not None:
                sender.fail(f"stage {self.config.stage} failed: {exc}")
            raise
        finally:
            with self._lock:
                self._upstreams.pop(request_id, None)
        if sender is not None:
            sender.finish()
        with self._lock:
            self._sessions[request_id] = Session(request_id=request_id, tenant=tenant, kv=kv,
                                                 token_ids=list(token_ids), save=save, saved_tokens=len(token_ids),
                                                 unsaved_input=self._no_rows(), touched=time.monotonic())
        if save:
            self._save_recomputed(job, restore, store)
        log.info("restore %s finished on stage %d: %d units loaded, %d computed (%s-wise), %.3f s", request_id,
                 self.config.stage, summary.loaded, summary.computed, summary.mode, summary.elapsed_s)
        self.metrics.restores.labels(input_mode, summary.mode).inc()
        self.metrics.restore_seconds.observe(summary.elapsed_s)
        self._refresh_pool_gauges()
        return summary

    def _abandon(self, request_id: str) -> None:
        """A restore that will not finish: out of the scheduler, its KV back to the pool."""
        with self.core.cond:
            if request_id in self.core.restores:
                self.core.fail(request_id, RestoreCancelledError(f"request {request_id!r} was abandoned"))
        self.pool.release(request_id)

    def _sender(self, request_id: str, *, hold: bool) -> DeliverySender | None:
        return None if self.next_stage is None else DeliverySender(self.next_stage, request_id, hold=hold)

    def _save_recomputed(self, job: RestoreJob, restore: StageRestore, store: ChunkStore) -> None:
        """Store again the chunks a restore recomputed because their load missed."""
        missed = restore.missed_units()
        if not missed:
            return
        keys = [job.keys[i] for i in missed] if restore.spec.mode == "token" else list(job.keys)
        self._saver.submit(self._guarded, restore.request_id, save_chunks, restore.kv, job, store,
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
        upstream.on_wake(self.core.wake)
        with self._lock:
            self._upstreams[request_id] = upstream
            early = self._mailbox.pop(request_id, [])
        for event in early:
            event(upstream)
        return upstream

    # ------------------------------------------------------------------------------------ forward
    def forward(self, meta: ForwardMeta, hidden: torch.Tensor | None, *,
                max_tokens: int | None = None) -> ForwardAnswer:
        """Run this stage's layers over new tokens of a request (in the engine's next steps), then the
        next stage's (or sample the next token). `max_tokens`: what its grant lets a new session hold."""
        session = self._session_for(meta, max_tokens)
        session.touched = time.monotonic()
        if not meta.save:  # a restored session is told only now whether to store what comes
            session.save = False
        if meta.start != len(session.token_ids):
            raise ConflictError(f"request {meta.request_id!r} holds {len(session.token_ids)} tokens, not {meta.start}")
        if meta.start + len(meta.token_ids) > session.kv.capacity:
            raise ConflictError(f"request {meta.request_id!r} would exceed its reserved {session.kv.capacity} tokens")
        x = self._stage_input(meta.token_ids, hidden)  # [T, hidden]
        sample_with = (meta.temperature, meta.seed) if self.next_stage is None else None
        item = ForwardItem(request_id=meta.request_id, kv=session.kv, start=meta.start, rows=x, sample=sample_with)
        with self.core.cond:
            self.core.forwards.append(item)
            self.core.cond.notify_all()
        out = item.future.result()
        session.token_ids.extend(meta.token_ids)
        if session.save and self.config.stage > 0:  # stage 0's input is the embedding: never stored
            session.unsaved_input = torch.cat([session.unsaved_input, x])
        self.metrics.forward_tokens.inc(len(meta.token_ids))
        if session.save:
            self._save_filled(session)
            if len(meta.token_ids) > 1:  # a prompt's prefill: its partial last chunk too, so it restores whole
                self._save_tail(session)
        if isinstance(out, int):
            return ForwardAnswer(token=out)
        assert self.next_stage is not None  # only the last stage samples
        return self.next_stage.forward(meta, out)

    def _session_for(self, meta: ForwardMeta, max_tokens: int | None) -> Session:
        with self._lock:
            session = self._sessions.get(meta.request_id)
        if session is not None:
            if session.tenant != meta.tenant:
                raise GrantError(f"request {meta.request_id!r} belongs to another tenant")
            return session
        if meta.start != 0:
            raise UnknownRequestError(f"request {meta.request_id!r} has no KV on stage {self.config.stage}")
        self._store(meta.tenant)  # an unknown tenant is refused before anything is allocated
        self._check_tokens(meta.token_ids, meta.reserve_tokens)
        _check_granted(len(meta.token_ids) + meta.reserve_tokens, max_tokens)
        self._check_new(meta.request_id)
        kv = self.pool.allocate(meta.request_id, len(meta.token_ids) + meta.reserve_tokens, tenant=meta.tenant)
        session = Session(request_id=meta.request_id, tenant=meta.tenant, kv=kv, token_ids=[], save=meta.save,
                          saved_tokens=0, unsaved_input=self._no_rows(), touched=time.monotonic())
        with self._lock:
            self._sessions[meta.request_id] = session
        self._refresh_pool_gauges()
        log.info("request %s opened on stage %d: %d tokens, %d reserved, save %s", meta.request_id,
                 self.config.stage, len(meta.token_ids), meta.reserve_tokens, meta.save)
        return session

    def _stage_input(self, token_ids: list[int], hidden: torch.Tensor | None) -> torch.Tensor:
        if self.config.stage == 0:
            self._check_tokens(token_ids, 0)
            return self.model.embed(torch.tensor(token_ids, dtype=torch.long))  # [T, hidden]
        expected = (len(token_ids), self.model.config.hidden_size)
        if hidden is None or tuple(hidden.shape) != expected:
            raise BadRequestError(f"stage {self.config.stage} needs hidden states of shape {expected}")
        return hidden.to(self.model.device, self.model.dtype)

    def _no_rows(self) -> torch.Tensor:
        return self.model.embed(torch.zeros(0, dtype=torch.long))  # [0, hidden]

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
        self._saver.submit(self._guarded, session.request_id, self._store_chunks, session.kv, job, keys, inputs, first,
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
        self._saver.submit(self._guarded, session.request_id, self._store_chunks, session.kv, job, [tail],
                           session.unsaved_input, session.saved_tokens, self._store(session.tenant))

    def _store_chunks(self, kv: KVBuffer, job: RestoreJob, keys: list[Any], inputs: torch.Tensor, first: int,
                      store: ChunkStore) -> None:
        fingerprint = self.model.fingerprint()
        written = save_chunks(kv, job, store, model_fingerprint=fingerprint, keys=keys)
        if self.config.stage > 0:
            written += save_boundaries(job, inputs, store, model_fingerprint=fingerprint, keys=keys,
                                       first_row_token=first)
        self.metrics.saved_chunks.inc(len(keys))
        self.metrics.saved_bytes.inc(written)

    def _guarded(self, request_id: str, fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Saves run off the critical path: a failure is logged and counted (the chunk is recomputed later)."""
        try:
            fn(*args, **kwargs)
        except Exception:
            log.exception("%s: saving its chunks on stage %d failed", request_id, self.config.stage)
            self.metrics.save_failures.inc()

    # ------------------------------------------------------------------------------------ housekeeping
    def release(self, request_id: str) -> bool:
        """Free a request's KV; a restore still running for it stops (its caller gets an error)."""
        with self.core.cond:
            if request_id in self.core.restores:
                self.core.fail(request_id, RestoreCancelledError(f"request {request_id!r} was released"))
        with self._lock:
            self._sessions.pop(request_id, None)
            self._mailbox.pop(request_id, None)
        released = self.pool.release(request_id)
        self._refresh_pool_gauges()
        if released:
            log.info("request %s released on stage %d", request_id, self.config.stage)
        return released

    def can_admit_typical(self) -> bool:
        """Whether the pool has room for a typical request now (`/readyz`)."""
        return self.pool.free_blocks >= self.pool.blocks_for(self.config.typical_request_tokens)

    def _reap_idle(self) -> None:
        """Free every session idle longer than `hold_ttl_s`: no hold outlives the coordinator's use of it."""
        ttl = self.config.hold_ttl_s
        while not self._closed.wait(min(ttl / 4, 30.0)):
            now = time.monotonic()
            with self._lock:
                idle = [r for r, s in self._sessions.items() if now - s.touched > ttl]
            for request_id in idle:
                log.warning("request %s held KV on stage %d unused for over %.0f s: freed", request_id,
                            self.config.stage, ttl)
                self.release(request_id)

    def kv_of(self, request_id: str) -> torch.Tensor:
        """[L_s, 2, Hkv, tokens, D]: the KV this stage holds for the request's tokens so far."""
        with self._lock:
            session = self._sessions.get(request_id)
        if session is None:
            raise UnknownRequestError(f"request {request_id!r} has no KV on stage {self.config.stage}")
        return session.kv.data[:, :, :, : len(session.token_ids)]

    def busy(self) -> dict[str, Any]:
        """Seconds the compute loop and each channel have been busy since start (utilisation = rate)."""
        return self.metrics.busy_totals()

    def flush(self) -> None:
        """Wait for every queued save (tests, shutdown)."""
        self._saver.submit(lambda: None).result()

    def _stepped(self, plan: StepPlan, seconds: float) -> None:
        requests = plan.request_ids()
        self.metrics.step(seconds, tokens=plan.tokens + sum(self._unit_tokens(t.request_id, t.unit)
                                                              for t in plan.token_units), requests=len(requests))

    def _unit_tokens(self, request_id: str, unit: int) -> int:
        with self.core.cond:
            restore = self.core.restores.get(request_id)
        if restore is None:
            return 0
        start, end = restore.unit_tokens[unit]
        return end - start

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


def _check_granted(tokens: int, max_tokens: int | None) -> None:
    if max_tokens is not None and tokens > max_tokens:
        raise GrantError(f"{tokens} tokens asked; the coordinator granted at most {max_tokens}")


def sample(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    """The next token from logits [vocab]: greedy at temperature 0, else sampled reproducibly (seed, position)."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + position)
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)  # [vocab]
    return int(torch.multinomial(probs, 1, generator=generator))

