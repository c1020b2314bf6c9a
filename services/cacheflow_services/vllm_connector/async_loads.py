"""Restores that never hold vLLM's batch back (`async_loads`, the default).

vLLM's scheduler parks a request whose prefix CacheFlow holds in WAITING_FOR_REMOTE_KVS, its blocks
allocated, and keeps stepping the rest of the batch. The worker side hands each such load to the restore
engine: requests waiting at the same time restore together in the one batch scheduler (the stage
workers' own), and a request arriving later joins the batch in flight. Its loads run on the engine's
channel threads all the time; its compute steps run on vLLM's own thread, between vLLM's steps:

* a step that scheduled no tokens (every request is waiting for its restore) drives the restores until
  one finishes (or `IDLE_SLICE_S` passes, so that a new request is seen);
* a step with work of vLLM's own runs one restore step after it, if one is ready: the batch goes on, and
  the restores with it.

Not a thread of its own: vLLM's CPU kernels (its attention, and the oneDNN GEMMs the shared runtime calls)
keep process-wide scratch buffers, and computing beside vLLM's forward from a second thread corrupted
memory (a batch of 8 restores aborted with "double free or corruption"). A background thread only builds
each restore (its chunk lookups) and submits it. As a restore finishes, vLLM's thread lands it in the
request's blocks and the next `get_finished` returns the request, with the blocks vLLM must recompute (a
restore that failed, was cancelled or timed out, or chunks missed with `on_miss="vllm"`) reported through
vLLM's load-error path in the same pass. Every load is reported exactly once, whatever happens to it:
vLLM frees a waiting request's blocks only then.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from cacheflow_common.engine import Engine, RestoreJob, RestoreResult, StageRestore, as_result
from cacheflow_common.errors import CacheFlowError
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.stage_api import RestoreSummary
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.vllm_connector.plan import LoadSpec

log = logging.getLogger(__name__)

IDLE_SLICE_S = 0.05  # longest an idle step drives the restores: bounds how late a new request is seen
JOIN_S = 10.0


class Restorer(Protocol):
    """What the worker engine lends the background loads."""

    @property
    def store(self) -> ChunkStore: ...
    @property
    def policy(self) -> str: ...

    def engine(self) -> Engine: ...
    def job(self, spec: LoadSpec) -> RestoreJob: ...
    def buffer(self, spec: LoadSpec, job: RestoreJob) -> KVBuffer: ...
    def land(self, spec: LoadSpec, job: RestoreJob, result: RestoreResult, *, batch: int) -> set[int]: ...
    def after_chunk(self, job: RestoreJob, kv: KVBuffer) -> Callable[[int], None] | None: ...
    def failed_load(self, spec: LoadSpec, exc: BaseException) -> set[int]: ...
    def event(self, kind: str, **fields: object) -> None: ...


class RequestFinished(CacheFlowError):
    """vLLM finished (aborted) the request while its prefix was being restored."""


@dataclass
class _Pending:
    spec: LoadSpec
    started_s: float
    batch: int  # loads in flight when it started: its own step's and those before
    restore: StageRestore | None = None  # once submitted
    job: RestoreJob | None = None
    error: BaseException | None = None  # why it was cancelled: vLLM finished the request, or it timed out

    @property
    def aborted(self) -> bool:
        return isinstance(self.error, RequestFinished)


class AsyncLoads:
    def __init__(self, restorer: Restorer, *, timeout_s: float) -> None:
        self.restorer = restorer
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._pending: dict[str, _Pending] = {}
        self._finished: dict[str, set[int]] = {}  # request -> the blocks vLLM must recompute
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="cacheflow-async-loads", daemon=True)
        self._thread.start()

    def start(self, specs: Iterable[LoadSpec]) -> None:
        """Queue restores; returns at once (vLLM's forward thread)."""
        now = time.perf_counter()
        specs = list(specs)
        self.restorer.engine()  # started here, on vLLM's thread: its runtime is found on this thread's stack
        with self._cond:
            in_flight = len(self._pending) + len(specs)
            for spec in specs:
                self._pending[spec.req_id] = _Pending(spec, now, batch=in_flight)
                self._tasks.put(lambda spec=spec: self._begin(spec))  # type: ignore[misc]

    def collect(self, finished_requests: Iterable[str], *, idle: bool) -> tuple[set[str], set[int]]:
        """On vLLM's thread, after its step: compute the restores (until one finishes when `idle`, the step
        having scheduled no tokens; else one restore step), land the finished ones, and return the
        requests whose restore ended since the last call with the blocks vLLM must recompute.
        `finished_requests`: requests vLLM finished (their restores are cancelled)."""
        self._cancel_finished_and_late(set(finished_requests))
        if self._pending:
            engine = self.restorer.engine()
            if idle:
                deadline = time.perf_counter() + IDLE_SLICE_S
                engine.run_until(lambda: self._any_done() or time.perf_counter() > deadline)
            else:
                engine.step()
        for pending, done in self._done():
            self._land(pending, done)
        with self._cond:
            finished, self._finished = self._finished, {}
        return set(finished), set().union(*finished.values())

    def _cancel_finished_and_late(self, finished_requests: set[str]) -> None:
        now = time.perf_counter()
        with self._cond:
            for request_id in finished_requests & set(self._pending):
                self._cancel(self._pending[request_id], RequestFinished(f"vLLM finished request {request_id}"))
            for pending in list(self._pending.values()):
                if pending.error is None and now - pending.started_s > self.timeout_s:
                    self._cancel(pending, TimeoutError(f"the restore ran past restore_timeout_s={self.timeout_s}"))

    def _any_done(self) -> bool:
        with self._cond:
            finished = bool(self._finished)
        return finished or bool(self._done())

    def _done(self) -> list[tuple[_Pending, Future[RestoreSummary]]]:
        with self._cond:
            return [(p, p.restore.done) for p in self._pending.values()
                    if p.restore is not None and p.restore.done.done()]

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._pending)

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join(JOIN_S)

    # -- building, on the background thread ------------------------------------------------------------
    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except Exception:  # a bug here must not stop every later load
                log.exception("CacheFlow background load task failed")

    def _begin(self, spec: LoadSpec) -> None:
        r = self.restorer
        with self._cond:
            pending = self._pending.get(spec.req_id)
        if pending is None or pending.aborted:
            self._complete(spec.req_id, set())
            return
        if pending.error is not None:
            self._complete(spec.req_id, r.failed_load(spec, pending.error))
            return
        try:
            self._submit(pending)
        except Exception as exc:  # it never started: vLLM recomputes it
            self._complete(spec.req_id, r.failed_load(spec, exc))

    def _submit(self, pending: _Pending) -> None:
        """Build the restore (its chunk lookups) and hand it to the engine; vLLM's thread computes and lands it."""
        spec, r = pending.spec, self.restorer
        job = r.job(spec)
        engine = r.engine()
        kv = r.buffer(spec, job)
        restore = engine.submit(spec.req_id, job, r.store, kv, policy=r.policy, input_mode="boundary",
                                arrival_s=pending.started_s, on_loaded=r.after_chunk(job, kv))
        # nothing after this may fail: the restore now owns the request's blocks
        with self._cond:
            pending.job, pending.restore = job, restore
            if pending.error is not None:  # cancelled while it was being built
                engine.cancel(spec.req_id, pending.error)
        try:
            r.event("load_started", req=spec.req_id, tokens=len(spec.token_ids), in_flight=pending.batch)
        except Exception:
            log.exception("CacheFlow could not log the start of %s's restore", spec.req_id)

    def _land(self, pending: _Pending, done: Future[RestoreSummary]) -> None:
        """A finished restore into the request's blocks (on vLLM's thread: landing calls vLLM's kernels)."""
        spec, r, restore, job = pending.spec, self.restorer, pending.restore, pending.job
        assert restore is not None and job is not None
        restore.kv.seal()  # a load still in flight (the restore failed or was cancelled) must not write from here on
        if pending.aborted:  # nobody reads the blocks: report the load, land nothing
            self._complete(spec.req_id, set())
            return
        try:
            failed = r.land(spec, job, as_result(restore, done.result()), batch=pending.batch)
        except Exception as exc:
            failed = r.failed_load(spec, exc)
        self._complete(spec.req_id, failed)

    def _complete(self, request_id: str, failed: set[int]) -> None:
        """Report a load, once: vLLM schedules the request (or frees its blocks) when it reads it."""
        with self._cond:
            if self._pending.pop(request_id, None) is not None:
                self._finished[request_id] = failed
                self._cond.notify_all()

    def _cancel(self, pending: _Pending, error: BaseException) -> None:
        """Stop a restore (the caller holds `_cond`); one not submitted yet is stopped when its turn comes."""
        pending.error = pending.error or error
        if pending.restore is not None:
            self.restorer.engine().cancel(pending.spec.req_id, error)
