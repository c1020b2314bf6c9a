"""Prometheus metrics of one stage worker (its own registry, so several can live in one test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.restores = Counter("cacheflow_worker_restores", "Restores by input and mode", ["input", "mode"],
                                registry=r)
        self.restore_seconds = Histogram("cacheflow_worker_restore_seconds", "Restore time on this stage",
                                         buckets=(0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100), registry=r)
        self.restore_failures = Counter("cacheflow_worker_restore_failures", "Restores that failed, by reason",
                                        ["reason"], registry=r)
        self.forward_tokens = Counter("cacheflow_worker_forward_tokens", "Tokens run through this stage", registry=r)
        self.saved_chunks = Counter("cacheflow_worker_saved_chunks", "Chunks stored (KV and boundary)", registry=r)
        self.saved_bytes = Counter("cacheflow_worker_saved_bytes", "Bytes stored", registry=r)
        self.save_failures = Counter("cacheflow_worker_save_failures", "Background saves that failed", registry=r)
        self.pool_used_blocks = Gauge("cacheflow_worker_pool_used_blocks", "KV pool blocks in use", registry=r)
        self.pool_capacity_blocks = Gauge("cacheflow_worker_pool_capacity_blocks", "KV pool size", registry=r)
        self.requests = Gauge("cacheflow_worker_requests", "Requests holding KV on this stage", registry=r)
