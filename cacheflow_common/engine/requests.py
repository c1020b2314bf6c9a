"""Everything a stage holds for one request, in one record (`StageRequest`: its pool grant and, while it
restores, the engine's restore among its fields), and the one map of them (`RequestTable`), keyed once and
under the engine's lock: the engine finds a restore through its request's record.

A stage worker's request (`StageEngine` tells its life): admitted (its KV granted from the pool) by a
restore or by its first forward → restored → forward* → released. Admission is one call
(`RequestTable.admit`: the conflict check, the pool's grant, the record), and so is release
(`RequestTable.release`: a restore still running stops, the record leaves the map, its grant goes back to
the pool). A restore the engine is handed without an admitted request (the vLLM connector's, the library's:
their KV is the caller's) gets a record of its own that leaves with it (`start_restore`, `end_restore`).

A pipelined restore's deliveries may come before its restore call does: they wait in the record's mailbox
until the restore attaches its upstream input.

Nothing is held for strangers: a delivery opens a mailbox only under a grant (`Grant`, op "deliver") for
that request, one grant per request's stream; the stream holds at most the grant's `max_tokens` rows
and the bytes they need, and a mailbox whose restore never comes is dropped when its grant expires. A
restore takes over the mailbox only when its own grant is for the same tenant and tokens.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cacheflow_common.engine.pool import KVPool, PoolGrant
from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.errors import BadRequestError, CacheFlowError, GrantError
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.restore.upstream import UpstreamInput

if TYPE_CHECKING:  # grants are checked by the worker's HTTP layer; the engine (and so vLLM's process, which
    # runs it for the connector) need not load the signature code
    from cacheflow_common.auth import Grant

MAILBOX_CHUNKS = 65536  # deliveries held for restores not yet started (bounds memory if one never comes)

Delivery = Callable[[UpstreamInput], None]  # one event from the previous stage: a chunk, its end, or a failure


class ConflictError(BadRequestError):
    """The request does not fit this stage's state for it (HTTP 409): wrong position, over its reserve."""


@dataclass
class StageRequest:
    """One request on this stage. Until it holds KV (a pool grant, or its restore's caller's buffer) it is
    only a mailbox of early deliveries."""

    request_id: str
    tenant: str = ""
    grant: PoolGrant | None = None  # its KV from the pool, once admitted
    kv: KVBuffer | None = None  # where its KV is: its grant's buffer, or a restore's caller's
    restore: StageRestore | None = None  # the engine's restore of its prefix, while that runs
    transient: bool = False  # admitted by its restore alone (its KV the caller's): leaves when that ends
    token_ids: list[int] = field(default_factory=list)  # every token whose KV is in `kv`, in order
    restoring: bool = False  # its restore call runs (admission to tokens recorded): forwards wait for it
    save: bool = True  # store whole chunks as they fill up
    saved_tokens: int = 0  # tokens [0, saved_tokens) are in storage (whole chunks, or the restored prefix)
    unsaved_input: torch.Tensor | None = None  # [len(token_ids) - saved_tokens, hidden]: this stage's input
    touched: float = field(default_factory=time.monotonic)  # last use (idle past the hold TTL: released)
    upstream: UpstreamInput | None = None  # a pipelined restore's input, while it restores
    mailbox: list[Delivery] = field(default_factory=list)  # deliveries that came before the restore
    digest: str = ""  # its restore grant's digest of the tokens (a delivery stream must match it)
    stream: Grant | None = None  # the grant its deliveries came under
    delivered_rows: int = 0
    delivered_bytes: int = 0


class RequestTable:
    """The stage's requests by id, under the engine's lock (`lock`: reentrant, so the engine's own steps may
    call in here while they hold it); events for a request go through its record.

    `pool`: where admitted requests' KV comes from (None: this engine admits no requests of its own);
    `stop_restore`: stops the restore of a request released while it restores; `on_stream_closed`: a
    released request's delivery grant is used up."""

    def __init__(self, lock: threading.Condition, *, stage: int, pool: KVPool | None,
                 stop_restore: Callable[[str], None], on_stream_closed: Callable[[Grant], None]) -> None:
        self.stage = stage
        self._lock = lock
        self._requests: dict[str, StageRequest] = {}
        self._pool = pool
        self._stop_restore = stop_restore
        self._on_stream_closed = on_stream_closed

    def get(self, request_id: str) -> StageRequest | None:
        with self._lock:
            return self._requests.get(request_id)

    def admit(self, request: StageRequest, n_tokens: int) -> StageRequest:
        """Admit a new request: its KV for `n_tokens` granted from the pool (PoolFullError if none), the
        deliveries that came before it taken over. A second admission of the same id is a conflict, found
        before the pool is asked (and again under the lock, for two racing admissions)."""
        if self._pool is None:
            raise CacheFlowError("this engine has no KV pool: its callers hand each restore its KV")
        with self._lock:
            self._refuse_second(request.request_id)
        request.grant = grant = self._pool.grant(n_tokens, tenant=request.tenant)
        request.kv = grant.kv
        try:
            return self._add(request)
        except (ConflictError, GrantError):
            self._pool.give_back(grant)
            raise

    def _refuse_second(self, request_id: str) -> None:
        """ConflictError if the request holds KV here already (the caller holds the lock)."""
        early = self._requests.get(request_id)
        if early is not None and early.grant is not None:
            raise ConflictError(f"request {request_id!r} already holds KV on stage {self.stage}")

    def _add(self, request: StageRequest) -> StageRequest:
        with self._lock:
            self._refuse_second(request.request_id)
            early = self._requests.get(request.request_id)
            if early is not None and early.stream is not None:
                if (early.stream.tenant, early.stream.digest) != (request.tenant, request.digest):
                    del self._requests[request.request_id]
                    raise GrantError(f"deliveries for request {request.request_id!r} came under a grant for other "
                                     "tokens or another tenant: dropped")
                request.mailbox, request.stream = early.mailbox, early.stream
                request.delivered_rows, request.delivered_bytes = early.delivered_rows, early.delivered_bytes
            self._requests[request.request_id] = request
            return request

    def deliver(self, grant: Grant, event: Delivery, *, rows: int = 0, nbytes: int = 0, max_bytes: int = 0) -> None:
        """Hand an event from the previous stage (under the delivery `grant`) to the request's restore, or keep
        it until that starts; `rows`, `nbytes`: what a chunk adds, within the grant's `max_tokens` rows and
        `max_bytes`."""
        with self._lock:
            request = self._requests.get(grant.request_id)
            if request is None:
                request = self._requests[grant.request_id] = StageRequest(grant.request_id, tenant=grant.tenant)
            if request.stream is None:
                if request.tenant != grant.tenant or (request.digest and request.digest != grant.digest):
                    raise GrantError(f"the delivery grant is not for request {grant.request_id!r} as it was restored")
                request.stream = grant
            elif request.stream.nonce != grant.nonce:
                raise GrantError(f"request {grant.request_id!r} takes deliveries under another grant")
            if request.delivered_rows + rows > grant.max_tokens or request.delivered_bytes + nbytes > max_bytes > 0:
                raise ConflictError(f"deliveries for request {grant.request_id!r} exceed its grant "
                                    f"({grant.max_tokens} tokens)")
            request.delivered_rows += rows
            request.delivered_bytes += nbytes
            upstream = request.upstream
            if upstream is None:
                if sum(len(r.mailbox) for r in self._requests.values()) >= MAILBOX_CHUNKS:
                    raise ConflictError("too many deliveries for restores that have not started")
                request.mailbox.append(event)
                return
        event(upstream)

    def attach(self, request_id: str, upstream: UpstreamInput) -> None:
        """The restore's upstream input: it receives every delivery so far, then each as it comes."""
        with self._lock:
            request = self._requests[request_id]
            request.upstream, early, request.mailbox = upstream, request.mailbox, []
        for event in early:
            event(upstream)

    def detach(self, request_id: str) -> None:
        with self._lock:
            request = self._requests.get(request_id)
            if request is not None:
                request.upstream = None

    def release(self, request_id: str) -> StageRequest | None:
        """Free everything the stage holds for a request (its restore, if one runs, stops first); the record
        released, if there was one."""
        self._stop_restore(request_id)
        with self._lock:
            request = self._requests.pop(request_id, None)
        if request is not None and request.grant is not None and self._pool is not None:
            self._pool.give_back(request.grant)
        if request is not None and request.stream is not None:
            self._on_stream_closed(request.stream)
        return request

    def idle(self, ttl_s: float) -> list[str]:
        """Requests unused for longer than `ttl_s`, and mailboxes whose delivery grant has expired."""
        now = time.monotonic()
        with self._lock:
            return [r for r, request in self._requests.items() if now - request.touched > ttl_s
                    or (request.kv is None and request.stream is not None and request.stream.expired())]

    # -- the engine's restores (called under its lock) ------------------------------------------------
    def start_restore(self, restore: StageRestore) -> None:
        """`restore` runs for its request: on the admitted record, or on a record of its own."""
        with self._lock:
            request = self._requests.get(restore.request_id)
            if request is None or request.kv is None:
                if request is not None:  # deliveries that came for it: they are its input's, not the record's
                    raise ConflictError(f"request {restore.request_id!r} took deliveries but was never admitted")
                request = self._requests[restore.request_id] = StageRequest(restore.request_id, kv=restore.kv,
                                                                            transient=True)
            if request.restore is not None:
                raise ConflictError(f"request {restore.request_id!r} is already restoring on stage {self.stage}")
            request.restore = restore

    def end_restore(self, request_id: str) -> StageRestore | None:
        """The restore ended (finished or failed): off its record, and a record of its own leaves with it."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None:
                return None
            restore, request.restore = request.restore, None
            if request.transient:
                del self._requests[request_id]
            return restore

    def restore_of(self, request_id: str) -> StageRestore | None:
        with self._lock:
            request = self._requests.get(request_id)
            return None if request is None else request.restore

    def restores(self) -> list[StageRestore]:
        """Every restore running, in the order their requests came."""
        with self._lock:
            return [r.restore for r in self._requests.values() if r.restore is not None]
