"""What the coordinator does for a request, whatever the API in front of it.

A completion: check the prompt, look up how much of its prefix the pods hold, wait for a batch
slot, restore that prefix on every stage at once (each stage's mode by its L_delta), prefill the rest of the prompt
through the stages (first token: TTFT), free the slot, decode the remaining tokens, free the KV.
The workers store every new whole chunk as it fills, so the next request sharing the prefix restores it.

A restore (`POST /v1/restore`): the same up to the restored prefix; the KV stays held on the workers
until it is released (or `held_restore_s` passes), so a client can prepare a prefix before it needs it.

Every check comes before a request takes its place in the queue, so a refused request holds nothing.
Once queued, a request can be stopped at any point (`stop`: its client went away, or its restore was
cancelled): it leaves the queue or frees its slot, and every stage drops it, stopping a restore there.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from cacheflow_common.errors import BadRequestError, UnauthorizedError
from cacheflow_common.sched.policies import POLICIES
from cacheflow_common.stage_api import RestoreSummary
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.coordinator.admission import Admission, QueueFullError, Ticket
from cacheflow_services.coordinator.cluster import Cluster, ModelInfo
from cacheflow_services.coordinator.completion import Completion
from cacheflow_services.coordinator.config import CoordinatorConfig
from cacheflow_services.coordinator.metrics import CoordinatorMetrics
from cacheflow_services.coordinator.prefix import cached_prefix_tokens
from cacheflow_services.coordinator.stages import ChainError

log = logging.getLogger(__name__)
ADMISSION_TIMEOUT_S = 600.0
KEEP_FINISHED_RESTORES = 1024  # finished restore records kept for GET


class UnknownRestoreError(BadRequestError):
    """No restore with this id for this tenant (HTTP 404)."""


class TenantRefusedError(BadRequestError):
    """The storage pods refuse the tenant's credentials (HTTP 403)."""


@dataclass
class Request:
    """One admitted piece of work: a completion, or a restore held for later."""

    id: str
    tenant: str
    token_ids: list[int]  # the whole prompt (a restore: the prefix)
    cached_tokens: int  # tokens [0, cached) are restored from storage; the rest are prefilled
    policy: str  # the restore policy sent to the workers ("" = theirs)
    ticket: Ticket
    arrived: float  # perf_counter() before its prefix lookup: TTFT counts from here
    lookup_s: float  # finding how much of the prompt the pods hold
    queue_s: float = 0.0  # lookup done -> admitted
    stages: list[RestoreSummary] = field(default_factory=list)  # per-stage restore summaries
    restore_s: float = 0.0
    cancelled: threading.Event = field(default_factory=threading.Event)  # stopped: its failures are not failures


@dataclass
class RestoreRecord:
    request: Request
    state: str = "queued"  # queued | restoring | ready | failed | cancelled | released
    error: str = ""
    expires: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def view(self) -> dict[str, Any]:
        r = self.request
        return {"id": r.id, "state": self.state, "error": self.error, "prefix_tokens": len(r.token_ids),
                "cached_tokens": r.cached_tokens, "policy": r.policy, "batch": r.ticket.batch,
                "lookup_s": r.lookup_s, "queue_s": r.queue_s, "restore_s": r.restore_s,
                "stages": [s.model_dump() for s in r.stages]}


class Coordinator:
    def __init__(self, config: CoordinatorConfig, cluster: Cluster, model: ModelInfo,
                 metrics: CoordinatorMetrics | None = None) -> None:
        self.config = config
        self.cluster = cluster
        self.model = model
        self.metrics = metrics or CoordinatorMetrics()
        self.admission = Admission(max_batch=config.max_batch, window_s=config.batch_window_s,
                                   max_queue=config.max_queue, on_batch=self.metrics.batch_size.observe)
        self.metrics.watch_admission(lambda: self.admission.waiting, lambda: self.admission.running,
                                     self.admission.oldest_slot_age_s)
        self.metrics.declare(len(cluster.chain.urls), list(cluster.pod_up))  # zeros from start-up
        self._restores: dict[str, RestoreRecord] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        self._stop.set()
        self.admission.close()
        with self._lock:
            held = [r for r in self._restores.values() if r.state == "ready"]
        for record in held:
            self._release(record)

    def stuck(self) -> str:
        """Why no batch slot can be expected to free up ("" when one can): readiness fails meanwhile."""
        return self.admission.stuck(self.config.slot_stuck_s)

    # ------------------------------------------------------------------------------------ checks
    def check_prompt(self, token_ids: Sequence[int], max_new_tokens: int) -> None:
        """BadRequestError with the reason when the workers could not serve this prompt."""
        if not token_ids:
            raise BadRequestError("the prompt is empty")
        vocab = self.model.vocab_size
        if bad := next((t for t in token_ids if not 0 <= t < vocab), None):
            raise BadRequestError(f"token id {bad} is out of the model's vocabulary [0, {vocab})")
        if not 1 <= max_new_tokens <= self.config.max_new_tokens:
            raise BadRequestError(f"max_tokens must be 1..{self.config.max_new_tokens}, got {max_new_tokens}")
        if len(token_ids) + max_new_tokens > self.model.max_tokens:
            raise BadRequestError(f"prompt of {len(token_ids)} tokens + {max_new_tokens} new exceeds the model's "
                                  f"context of {self.model.max_tokens} tokens")

    def check_stop_ids(self, stop_ids: Sequence[int]) -> None:
        """BadRequestError naming the first stop token id outside the model's vocabulary (it could never stop)."""
        vocab = self.model.vocab_size
        if (bad := next((t for t in stop_ids if not 0 <= t < vocab), None)) is not None:
            raise BadRequestError(f"stop_token_ids: token id {bad} is out of the model's vocabulary [0, {vocab})")

    @staticmethod
    def check_policy(requested: str) -> str:
        """The restore policy for the workers ("": theirs). Adaptive `cacheflow` picks its mode on each
        stage, by that worker's profiled L_delta (token-wise on stages restoring from boundary activations)."""
        if requested and requested not in POLICIES:
            raise BadRequestError(f"unknown policy {requested!r}; choose one of {', '.join(POLICIES)}")
        return requested

    # ------------------------------------------------------------------------------------ admission
    def admit(self, token_ids: list[int], tenant: str, *, prefix_limit: int, policy: str, kind: str,
              gone: Callable[[], bool] = lambda: False) -> Request:
        """Look the prefix up and take a place in the queue (QueueFullError: HTTP 429); `gone`: the client
        left (it waits for no stage then)."""
        arrived = time.perf_counter()
        policy = self.check_policy(policy)  # every check before the queue: a refused request holds no slot
        self.cluster.wait_for_stages(self.config.stage_wait_s, gone=gone)  # a restarting stage costs time only
        store = self.cluster.stores.get(tenant)
        if store is None:
            raise BadRequestError(f"tenant {tenant!r} has no storage credentials on this coordinator")
        if kind == "cmpl" and policy == "compute-only":
            cached = 0  # vLLM on a miss: the whole prompt prefilled, batched like any prefill; nothing to look up
        else:
            try:
                cached = self._stored_prefix(token_ids, tenant, store, limit=prefix_limit)
            except UnauthorizedError as exc:
                raise TenantRefusedError(f"the storage pods refuse tenant {tenant!r}: {exc}") from exc
        lookup_s = time.perf_counter() - arrived
        request = Request(id=f"{kind}-{uuid.uuid4().hex[:20]}", tenant=tenant, token_ids=token_ids,
                          cached_tokens=cached, policy=policy, ticket=self.admission.enqueue(), arrived=arrived,
                          lookup_s=lookup_s)  # the queue last: nothing can fail once the request holds a place
        log.info("%s queued: tenant %s, %d prompt tokens, %d cached in storage, policy %s, lookup %.3f s",
                 request.id, tenant, len(token_ids), cached, request.policy or "the workers' default",
                 request.lookup_s)
        return request

    def _stored_prefix(self, token_ids: list[int], tenant: str, store: ChunkStore, *, limit: int) -> int:
        """Tokens of the longest prefix of `token_ids` (at most `limit`) whose chunks every stage holds."""
        return cached_prefix_tokens(token_ids, fingerprint=self.model.fingerprint, tenant=tenant,
                                    chunk_size=self.model.chunk_size, stage_layers=self.model.stage_layers,
                                    store=store, limit=limit)

    def _wait_turn(self, request: Request) -> bool:
        """Wait for the request's batch; False if it was withdrawn (cancelled) meanwhile."""
        admitted = self.admission.wait(request.ticket, ADMISSION_TIMEOUT_S) and not request.cancelled.is_set()
        request.queue_s = time.perf_counter() - request.arrived - request.lookup_s
        self.metrics.queue_seconds.observe(request.queue_s)
        if admitted:
            log.info("%s admitted to batch %d after %.3f s in the queue", request.id, request.ticket.batch,
                     request.queue_s)
        return admitted

    def stop_request(self, request: Request) -> None:
        """Stop a request wherever it is: out of the queue or its slot freed, dropped by every stage (a
        restore running there fails at once, so the thread waiting on it returns)."""
        if not request.cancelled.is_set():
            log.info("%s stopped", request.id)
        request.cancelled.set()
        self.admission.done(request.ticket)
        self.cluster.chain.release(request.id)

    def _restore(self, request: Request, reserve_tokens: int, save: bool = True) -> None:
        """Restore tokens [0, cached) on every stage (nothing when none are cached)."""
        if not request.cached_tokens:
            return
        began = time.perf_counter()
        request.stages = self.cluster.chain.restore(request.id, request.token_ids[: request.cached_tokens],
                                                    tenant=request.tenant, reserve_tokens=reserve_tokens,
                                                    policy=request.policy, arrived=request.arrived, save=save)
        request.restore_s = time.perf_counter() - began
        log.info("%s restored %d cached tokens in %.3f s; per stage: %s", request.id, request.cached_tokens,
                 request.restore_s, ", ".join(f"{s.stage}: {s.policy} {s.mode} ({s.computed} computed, "
                                              f"{s.loaded} loaded)" for s in request.stages))
        self.metrics.restore_seconds.observe(request.restore_s)
        self.metrics.record_restore(request.stages, request.cached_tokens, [len(r) for r in self.model.stage_layers])

    def _restore_or_recompute(self, request: Request, reserve_tokens: int, save: bool = True) -> None:
        """`_restore`, falling back when a stage fails to restore the prefix (not unreachable: that is
        waited for). A stage fed by the previous one cannot recompute a chunk it failed to load, e.g. a
        corrupt one with no boundary activations, and the pods drop such a chunk as they find it: so the
        prefix is looked up again and the part still stored before it restored instead; if none is left
        (or that fails too) the whole prompt is prefilled, as on a miss. Costs time, never the answer."""
        for attempt in (1, 2):
            try:
                self._restore(request, reserve_tokens, save)
                return
            except ChainError as exc:
                if exc.unreachable or request.cancelled.is_set():
                    raise
                self.cluster.chain.release(request.id)
                shorter = self._still_stored(request) if attempt == 1 else 0
                what = f"restoring its first {shorter} tokens instead" if shorter else "prefilling the whole prompt"
                log.warning("%s: restoring its %d cached tokens failed (%s); %s", request.id, request.cached_tokens,
                            exc, what)
                self.metrics.failures.labels(f"stage{exc.stage}:restore-{'shortened' if shorter else 'recomputed'}"
                                             ).inc()
                reserve_tokens += request.cached_tokens - shorter  # those tokens are prefilled now
                request.cached_tokens, request.stages = shorter, []
                if not shorter:
                    return

    def _still_stored(self, request: Request) -> int:
        """How much of the request's cached prefix the pods still hold whole, if less than it was (else 0)."""
        store = self.cluster.stores.get(request.tenant)
        if store is None or request.cached_tokens <= self.model.chunk_size:
            return 0
        try:
            found = self._stored_prefix(request.token_ids, request.tenant, store, limit=request.cached_tokens)
        except UnauthorizedError:
            return 0
        return found if found < request.cached_tokens else 0

    def _failed(self, request: Request, exc: BaseException) -> None:
        if request.cancelled.is_set():  # what fails once a request is stopped is the stopping
            log.info("%s ended after it was stopped: %s", request.id, exc)
            return
        cause = type(exc).__name__
        if isinstance(exc, ChainError):
            cause = f"stage{exc.stage}:{'unreachable' if exc.unreachable else exc.error or exc.status}"
            if exc.unreachable:
                self.cluster.mark_stage_down(exc.stage)
        self.metrics.failures.labels(cause).inc()
        log.warning("%s failed (%s): %s", request.id, cause, exc)

    # ------------------------------------------------------------------------------------ completions
    def complete(self, request: Request, *, max_new_tokens: int, temperature: float, seed: int,
                 stop_ids: frozenset[int], save: bool = True) -> Completion:
        """The new tokens, the first once the prefix is restored and the prompt prefilled; `abort` (or
        `close`) it at any point, from any thread, and its slot and KV are freed."""
        tokens = self._tokens(request, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                              stop_ids=stop_ids, save=save)
        return Completion(tokens, stop=lambda: self.stop_request(request))

    def _tokens(self, request: Request, *, max_new_tokens: int, temperature: float, seed: int,
                stop_ids: frozenset[int], save: bool) -> Generator[int, None, None]:
        chain = self.cluster.chain
        prompt = request.token_ids

        def start() -> Iterator[int] | None:
            """Restore and prefill; the stream, its first token next (None: stopped meanwhile)."""
            self._restore_or_recompute(request, reserve_tokens=len(prompt) - request.cached_tokens + max_new_tokens,
                                       save=save)
            if request.cancelled.is_set():
                return None
            return chain.stream(request.id, prompt[request.cached_tokens :], start=request.cached_tokens,
                                tenant=request.tenant, max_new_tokens=max_new_tokens, temperature=temperature,
                                seed=seed, reserve_tokens=len(prompt) + max_new_tokens, stop_ids=stop_ids, save=save)

        try:
            try:
                if not self._wait_turn(request):
                    return
                started = self._before_first_token(request, start)
                if started is None:
                    return
                first, tokens = started
            finally:
                self.admission.done(request.ticket)
            self.metrics.ttft.observe(time.perf_counter() - request.arrived)
            log.info("%s first token: TTFT %.3f s", request.id, time.perf_counter() - request.arrived)
            self.metrics.prefix_tokens.labels("restored").inc(request.cached_tokens)
            self.metrics.prefix_tokens.labels("prefilled").inc(len(prompt) - request.cached_tokens)
            yield first
            yield from tokens
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                self._failed(request, exc)
            raise
        finally:
            chain.release(request.id)

    def _before_first_token(self, request: Request, start: Callable[[], Iterator[int] | None]
                            ) -> tuple[int, Iterator[int]] | None:
        """`start` the request and take its first token; a stage found unreachable before then costs the
        request a wait for it (bounded by `stage_wait_s`) and one more try, not its answer: nothing has
        reached the client yet."""
        for attempt in (1, 2):
            try:
                tokens = start()
                return None if tokens is None else (next(tokens), tokens)
            except ChainError as exc:
                if attempt == 2 or not exc.unreachable or request.cancelled.is_set():
                    raise
                log.warning("%s: stage %d unreachable before the first token (%s); trying again once it is back",
                            request.id, exc.stage, exc)
                self.cluster.mark_stage_down(exc.stage)
                self.cluster.chain.release(request.id)
                self.cluster.wait_for_stages(self.config.stage_wait_s)
        return None

    # ------------------------------------------------------------------------------------ restores
    def start_restore(self, request: Request) -> RestoreRecord:
        """Restore `request`'s prefix and hold it; QueueFullError (429) when its tenant already has
        `max_held_restores` queued, restoring or held (its queue place is given back)."""
        record = RestoreRecord(request)
        with self._lock:
            held = sum(1 for r in self._restores.values() if r.request.tenant == request.tenant
                       and r.state in ("queued", "restoring", "ready"))
            if held >= self.config.max_held_restores:
                self.admission.done(request.ticket)
                raise QueueFullError(f"tenant {request.tenant!r} holds {held} restores (the limit per tenant): "
                                     "release one (DELETE /v1/restore/{id}) or retry later")
            self._restores[request.id] = record
        threading.Thread(target=self._run_restore, args=(record,), name=f"restore-{request.id}", daemon=True).start()
        return record

    def _run_restore(self, record: RestoreRecord) -> None:
        """Queue, then restore; a cancel at any point wins (its state stays `cancelled`, nothing held)."""
        request = record.request
        try:
            if not self._wait_turn(request) or not self._advance(record, "queued", "restoring"):
                return
            self._restore(request, reserve_tokens=0)
            record.expires = time.monotonic() + self.config.held_restore_s
            self._advance(record, "restoring", "ready")
        except Exception as exc:
            self._failed(request, exc)
            if self._advance(record, ("queued", "restoring"), "failed"):
                record.error = str(exc)
        finally:
            self.admission.done(request.ticket)
            if record.state == "cancelled":  # cancelled while it restored: free what the stages still hold
                self.cluster.chain.release(request.id)
            record.done.set()

    def _advance(self, record: RestoreRecord, before: str | tuple[str, ...], after: str) -> bool:
        """Move a restore from (one of) `before` to `after`, unless something (a cancel) moved it first."""
        with self._lock:
            if record.state not in ((before,) if isinstance(before, str) else before):
                return False
            record.state = after
            return True

    def restore_record(self, restore_id: str, tenant: str) -> RestoreRecord:
        with self._lock:
            record = self._restores.get(restore_id)
        if record is None or record.request.tenant != tenant:  # another tenant's id looks like no id
            raise UnknownRestoreError(f"no restore {restore_id!r}")
        return record

    def cancel(self, restore_id: str, tenant: str) -> RestoreRecord:
        """Cancel a queued or running restore (it leaves the queue, or every stage stops it), or release a
        finished one's KV."""
        record = self.restore_record(restore_id, tenant)
        if self._advance(record, ("queued", "restoring"), "cancelled"):
            self.stop_request(record.request)
        else:
            self._release(record)
        return record

    def _release(self, record: RestoreRecord) -> None:
        """Free a ready restore's KV (once, whoever asks first)."""
        if self._advance(record, "ready", "released"):
            self.cluster.chain.release(record.request.id)

    def _reap_loop(self) -> None:
        """Free restores held past their time; forget the oldest finished records."""
        while not self._stop.wait(1.0):
            now = time.monotonic()
            with self._lock:
                expired = [r for r in self._restores.values() if r.state == "ready" and r.expires < now]
                finished = [k for k, r in self._restores.items() if r.state in ("failed", "cancelled", "released")]
                for key in finished[: max(0, len(finished) - KEEP_FINISHED_RESTORES)]:
                    del self._restores[key]
            for record in expired:
                self._release(record)
