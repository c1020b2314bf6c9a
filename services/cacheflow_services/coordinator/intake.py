"""A request's way in and out of the batch slots: its prefix looked up, its queue place, its turn, its stop.

Every check comes before a request takes its place in the queue, so a refused request holds nothing.
Once queued, a request can be stopped at any point (`stop`: its client went away, or its restore was
cancelled): it leaves the queue or frees its slot, and every stage drops it, stopping a restore there.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from cacheflow_common.errors import BadRequestError, UnauthorizedError
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.store.prefix import cached_prefix_tokens
from cacheflow_services.coordinator.admission import Admission
from cacheflow_services.coordinator.checks import check_policy
from cacheflow_services.coordinator.cluster import Cluster, ModelInfo
from cacheflow_services.coordinator.config import CoordinatorConfig
from cacheflow_services.coordinator.metrics import CoordinatorMetrics
from cacheflow_services.coordinator.request import Request

ADMISSION_TIMEOUT_S = 600.0


class TenantRefusedError(BadRequestError):
    """The storage pods refuse the tenant's credentials (HTTP 403)."""


class Intake:
    def __init__(self, config: CoordinatorConfig, cluster: Cluster, model: ModelInfo, admission: Admission,
                 metrics: CoordinatorMetrics) -> None:
        self.config = config
        self.cluster = cluster
        self.model = model
        self.admission = admission
        self.metrics = metrics

    def admit(self, token_ids: list[int], tenant: str, *, prefix_limit: int, policy: str, kind: str,
              gone: Callable[[], bool] = lambda: False) -> Request:
        """Look the prefix up and take a place in the queue (QueueFullError: HTTP 429); `gone`: the client
        left (it waits for no stage then)."""
        arrived = time.perf_counter()
        policy = check_policy(policy)  # every check before the queue: a refused request holds no slot
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
        request = Request(id=f"{kind}-{uuid.uuid4().hex[:20]}", tenant=tenant, token_ids=token_ids,
                          cached_tokens=cached, policy=policy, ticket=self.admission.enqueue(), arrived=arrived,
                          lookup_s=time.perf_counter() - arrived)  # the queue last: nothing fails once it is queued
        request.log.info("queued: tenant %s, %d prompt tokens, %d cached in storage, policy %s, lookup %.3f s",
                         tenant, len(token_ids), cached, request.policy or "the workers' default", request.lookup_s)
        return request

    def still_stored(self, request: Request) -> int:
        """How much of the request's cached prefix the pods still hold whole, if less than it was (else 0)."""
        store = self.cluster.stores.get(request.tenant)
        if store is None or request.cached_tokens <= self.model.chunk_size:
            return 0
        try:
            found = self._stored_prefix(request.token_ids, request.tenant, store, limit=request.cached_tokens)
        except UnauthorizedError:
            return 0
        return found if found < request.cached_tokens else 0

    def wait_turn(self, request: Request) -> bool:
        """Wait for the request's batch; False if it was withdrawn (cancelled) meanwhile."""
        admitted = self.admission.wait(request.ticket, ADMISSION_TIMEOUT_S) and not request.cancelled.is_set()
        request.queue_s = time.perf_counter() - request.arrived - request.lookup_s
        self.metrics.queue_seconds.observe(request.queue_s)
        if admitted:
            request.log.info("admitted to batch %d after %.3f s in the queue", request.ticket.batch, request.queue_s)
        return admitted

    def leave_slot(self, request: Request) -> None:
        """The request is past its first token (or failed, or was withdrawn): its slot or place is free."""
        self.admission.done(request.ticket)

    def stop(self, request: Request) -> None:
        """Stop a request wherever it is: out of the queue or its slot freed, dropped by every stage (a
        restore running there fails at once, so the thread waiting on it returns)."""
        if not request.cancelled.is_set():
            request.log.info("stopped")
        request.cancelled.set()
        self.leave_slot(request)
        self.cluster.chain.release(request.id, request.tenant)

    def _stored_prefix(self, token_ids: list[int], tenant: str, store: ChunkStore, *, limit: int) -> int:
        """Tokens of the longest prefix of `token_ids` (at most `limit`) whose chunks every stage holds (all KV
        heads in one object, or split by heads as a tensor-parallel vLLM instance's ranks store them)."""
        return cached_prefix_tokens(token_ids, fingerprint=self.model.fingerprint, tenant=tenant,
                                    chunk_size=self.model.chunk_size, stage_layers=self.model.stage_layers,
                                    store=store, limit=limit, kv_heads=self.model.kv_heads)
