"""Prometheus metrics of one stage worker (its own registry, so several can live in one test process).

Utilisation, the paper's Fig. 5 quantities measured: the compute loop's busy seconds and each channel's
(counters: their rate is the busy share), and the share of the last `BUSY_WINDOW_S` seconds each was
busy (gauges, for a dashboard that shows them without a query).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cacheflow_common.stage_api import InputMode

BUSY_WINDOW_S = 10.0
INPUT_MODES = get_args(InputMode)


class BusyShare:
    """The share of the last `window_s` seconds a resource was busy, from the busy intervals it reports."""

    def __init__(self, window_s: float = BUSY_WINDOW_S) -> None:
        self.window_s = window_s
        self.total_s = 0.0
        self._intervals: deque[tuple[float, float]] = deque()  # (start, end), perf_counter
        self._lock = threading.Lock()

    def add(self, seconds: float, end: float | None = None) -> None:
        end = time.perf_counter() if end is None else end
        with self._lock:
            self.total_s += seconds
            self._intervals.append((end - seconds, end))

    def share(self, now: float | None = None) -> float:
        now = time.perf_counter() if now is None else now
        since = now - self.window_s
        with self._lock:
            while self._intervals and self._intervals[0][1] <= since:
                self._intervals.popleft()
            busy = sum(end - max(start, since) for start, end in self._intervals)
        return min(1.0, busy / self.window_s)


class WorkerMetrics:
    def __init__(self, n_channels: int = 1) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.started = time.perf_counter()
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
        self.steps = Counter("cacheflow_worker_steps", "Compute steps run", registry=r)
        self.step_tokens = Histogram("cacheflow_worker_step_tokens", "Tokens in one compute step",
                                     buckets=(1, 8, 64, 256, 512, 1024, 2048, 4096), registry=r)
        self.step_requests = Histogram("cacheflow_worker_step_requests", "Requests in one compute step",
                                       buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.compute_busy_seconds = Counter("cacheflow_worker_compute_busy_seconds",
                                            "Seconds the compute loop ran steps", registry=r)
        self.channel_busy_seconds = Counter("cacheflow_worker_channel_busy_seconds",
                                            "Seconds each storage channel spent loading", ["channel"], registry=r)
        self.compute_busy_share = Gauge("cacheflow_worker_compute_busy_share",
                                        f"Share of the last {BUSY_WINDOW_S:g} s the compute loop was busy", registry=r)
        self.channel_busy_share = Gauge("cacheflow_worker_channel_busy_share",
                                        f"Share of the last {BUSY_WINDOW_S:g} s each channel was busy", ["channel"],
                                        registry=r)
        self._compute = BusyShare()
        self._channels = [BusyShare() for _ in range(n_channels)]
        self.compute_busy_share.set_function(self._compute.share)
        for c, meter in enumerate(self._channels):
            self.channel_busy_share.labels(str(c)).set_function(meter.share)
            self.channel_busy_seconds.labels(str(c))  # zeros from start-up, not "no data"
        for input_mode in INPUT_MODES:
            for mode in ("token", "layer"):
                self.restores.labels(input_mode, mode)

    def step(self, seconds: float, *, tokens: int, requests: int) -> None:
        self.steps.inc()
        self.step_tokens.observe(tokens)
        self.step_requests.observe(requests)
        self.compute_busy_seconds.inc(seconds)
        self._compute.add(seconds)

    def channel_busy(self, channel: int, seconds: float) -> None:
        self.channel_busy_seconds.labels(str(channel)).inc(seconds)
        self._channels[channel].add(seconds)

    def busy_totals(self) -> dict[str, Any]:
        """Busy seconds since start, of the compute loop and of each channel, and the seconds since start."""
        return {"uptime_s": time.perf_counter() - self.started, "compute_s": self._compute.total_s,
                "channels_s": [meter.total_s for meter in self._channels]}

    def pool_changed(self, used_blocks: int, requests: int) -> None:
        """The pool's use after an admission or a release."""
        self.pool_used_blocks.set(used_blocks)
        self.requests.set(requests)
