"""Prometheus metrics of one storage pod (its own registry, so several pods can live in one test process)."""

from __future__ import annotations

import threading
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge

TENANT_COUNTS = ("hits", "misses", "corrupt", "read_bytes", "writes")  # what /v1/stats counts per tenant


class StorageMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reads = Counter("cacheflow_storage_reads", "Chunk reads by result", ["result"], registry=r)
        self.read_bytes = Counter("cacheflow_storage_read_bytes", "Bytes served to readers", registry=r)
        self.writes = Counter("cacheflow_storage_writes", "Chunk writes by result", ["result"], registry=r)
        self.written_bytes = Counter("cacheflow_storage_written_bytes", "Bytes stored", registry=r)
        self.evictions = Gauge("cacheflow_storage_evictions", "Objects evicted for capacity", registry=r)
        self.objects = Gauge("cacheflow_storage_objects", "Objects stored (memory/filesystem)", registry=r)
        self.used_bytes = Gauge("cacheflow_storage_used_bytes", "Bytes stored (memory/filesystem)", registry=r)
        self.capacity_bytes = Gauge("cacheflow_storage_capacity_bytes", "Capacity (0: unlimited)", registry=r)
        self.rate = Gauge("cacheflow_storage_link_bytes_per_second", "Shaped outgoing rate (0: unshaped)", registry=r)
        self.connections = Gauge("cacheflow_storage_connections", "Open authenticated data-plane connections",
                                 registry=r)
        self.pending = Gauge("cacheflow_storage_pending_connections", "Data-plane connections still in their hello",
                             registry=r)
        self.buffered_bytes = Gauge("cacheflow_storage_buffered_bytes", "Request bytes held in memory", registry=r)
        self.refused = Counter("cacheflow_storage_refused", "Requests refused, by reason", ["reason"], registry=r)
        for result in ("hit", "miss", "corrupt"):
            self.reads.labels(result)  # export zeros from the start: dashboards see the series before traffic
        for result in ("ok", "rejected", "failed"):
            self.writes.labels(result)


class TenantCounts:
    """Per-tenant request counts for `GET /v1/stats` (a tenant sees only its own; /metrics has the pod's)."""

    def __init__(self) -> None:
        self._counts: dict[str, Tally[str]] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts.setdefault(tenant, Tally())[what] += n

    def of(self, tenant: str) -> dict[str, int]:
        with self._lock:
            counts = self._counts.get(tenant, Tally())
            return {what: counts[what] for what in TENANT_COUNTS}
