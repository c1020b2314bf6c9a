"""Prometheus metrics of the coordinator (its own registry, so several can live in one test process).

Compute and I/O utilisation per stage are the rates of the busy-time and loaded-bytes counters
(`rate(cacheflow_stage_restore_busy_seconds_total[1m])`); per storage pod, the pods' own
`cacheflow_storage_read_bytes_total` against their configured link rate.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cacheflow_common.stage_api import RestoreSummary

LATENCY_BUCKETS = (0.01, 0.03, 0.1, 0.3, 0.5, 1, 2, 5, 10, 30, 60, 120)


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cacheflow_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("cacheflow_ttft_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.restore_seconds = Histogram("cacheflow_restore_seconds", "Restore time of a prefix on all stages",
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.queue_seconds = Histogram("cacheflow_queue_seconds", "Arrival to admission into a batch",
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("cacheflow_queue_depth", "Requests waiting for a batch", registry=r)
        self.running = Gauge("cacheflow_running", "Requests admitted and not yet at their first token", registry=r)
        self.slots_held = Gauge("cacheflow_coordinator_slots_held", "Batch slots held (requests admitted and not "
                                "yet at their first token, restores running)", registry=r)
        self.oldest_slot_age = Gauge("cacheflow_coordinator_oldest_slot_age_seconds", "How long the batch slot "
                                     "held longest has been held (0: none is)", registry=r)
        self.batch_size = Histogram("cacheflow_batch_size", "Requests admitted together",
                                    buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        self.prefix_tokens = Counter("cacheflow_prefix_tokens", "Prompt tokens by where their KV came from "
                                     "(restored: found in storage; prefilled: not stored)", ["source"], registry=r)
        self.restored_token_layers = Counter("cacheflow_restored_token_layers", "Token-layers restored, by how "
                                             "(computed or loaded)", ["how"], registry=r)
        self.stage_busy = Counter("cacheflow_stage_restore_busy_seconds", "Seconds a stage spent restoring",
                                  ["stage"], registry=r)
        self.stage_restores = Counter("cacheflow_stage_restores", "Restores per stage, by mode (token or layer)",
                                      ["stage", "mode"], registry=r)
        self.stage_loaded_bytes = Counter("cacheflow_stage_loaded_bytes", "KV bytes a stage loaded while restoring",
                                          ["stage"], registry=r)
        self.misses = Counter("cacheflow_misses", "Chunks that had to be recomputed, by cause", ["cause"], registry=r)
        self.failures = Counter("cacheflow_failures", "Requests that failed after admission, by cause", ["cause"],
                                registry=r)
        self.stage_up = Gauge("cacheflow_stage_up", "Whether a stage worker answers its probe", ["stage"], registry=r)
        self.pod_up = Gauge("cacheflow_pod_up", "Whether a storage pod answers its probe", ["pod"], registry=r)

    def watch_admission(self, waiting: Callable[[], float], held: Callable[[], float],
                        oldest_age_s: Callable[[], float]) -> None:
        """The queue and slot gauges read admission's state when scraped."""
        self.queue_depth.set_function(waiting)
        self.running.set_function(held)
        self.slots_held.set_function(held)
        self.oldest_slot_age.set_function(oldest_age_s)

    def record_restore(self, stages: list[RestoreSummary], n_tokens: int, stage_layers: list[int]) -> None:
        """Account one finished restore from the stages' summaries."""
        for summary, layers in zip(stages, stage_layers, strict=True):
            stage = str(summary.stage)
            self.stage_busy.labels(stage).inc(summary.elapsed_s)
            self.stage_restores.labels(stage, summary.mode).inc()
            self.stage_loaded_bytes.labels(stage).inc(summary.bytes_loaded)
            units = summary.computed + summary.loaded
            if units:
                for how, count in (("computed", summary.computed), ("loaded", summary.loaded)):
                    self.restored_token_layers.labels(how).inc(n_tokens * layers * count / units)
            for cause, count in summary.misses.items():
                self.misses.labels(cause).inc(count)

    def restore_modes(self, stage: int) -> dict[str, int]:
        """How many restores `stage` ran in each mode so far."""
        return {sample.labels["mode"]: int(sample.value) for metric in self.stage_restores.collect()
                for sample in metric.samples
                if sample.name.endswith("_total") and sample.labels["stage"] == str(stage)}
