"""Prometheus metrics of the coordinator (its own registry, so several can live in one test process).

Compute and I/O utilisation per stage are the rates of the busy-time and loaded-bytes counters
(`rate(cacheflow_stage_restore_busy_seconds_total[1m])`); per storage pod, the pods' own
`cacheflow_storage_read_bytes_total` against their link capacity.

No label is named like a label Prometheus or the Prometheus Operator attaches to a target (`pod`,
`service`, `namespace`, `instance`, `job`, `container`, `endpoint`): a scrape would rename it to
`exported_<name>` and aggregations by it would fold series together. Counters of known causes, routes
and stages exist at 0 from start-up (`declare`), so a healthy cluster's panels read 0, not "no data".
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cacheflow_common.sched.policies import POLICIES
from cacheflow_common.stage_api import RestoreSummary

LATENCY_BUCKETS = (0.01, 0.03, 0.1, 0.3, 0.5, 1, 2, 5, 10, 30, 60, 120)
SHARE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
TIME_SHARE_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0, 5.0)  # over 1: slower than recompute
# The routes a 200 is counted for, by what they serve. The `route` label of every request count is the
# template of the route it matched (`/v1/restore/{restore_id}`), or UNMATCHED: never a path a client chose.
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "restore": "/v1/restore"}
UNMATCHED = "unmatched"
# Why a stage's load missed (the unit was recomputed): the store did not serve it ("absent": also a copy the
# pod found corrupt), a section failed its check when it landed, or the loader itself failed.
MISS_CAUSES = ("absent", "crc", "truncated", "magic", "key", "layer", "tokens", "loader-error")
STAGE_FAILURES = ("restore-recomputed", "unreachable")  # per stage: `stage<s>:<what>`


class CoordinatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cacheflow_requests", "Requests answered, by route (its template: /v1/completions, "
                                "/v1/restore/{restore_id}, ...; unmatched) and HTTP status", ["route", "status"],
                                registry=r)
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
        self.pod_up = Gauge("cacheflow_pod_up", "Whether a storage pod answers its probe", ["storage_pod"],
                            registry=r)
        self._restore_shape_metrics(r)
        for route in ROUTES.values():
            self.requests.labels(route, "200")
        for cause in MISS_CAUSES:
            self.misses.labels(cause)
        for how in ("computed", "loaded"):
            self.restored_token_layers.labels(how)
        for source in ("restored", "prefilled"):
            self.prefix_tokens.labels(source)

    def _restore_shape_metrics(self, r: CollectorRegistry) -> None:
        """How each restore split its units between the two sides, per stage (two pointers: compute from the
        front, loads from the back)."""
        self.loaded_share = Histogram("cacheflow_restore_loaded_share", "Per restore and stage, the share of "
                                      "units loaded from storage (the rest recomputed)", ["stage"],
                                      buckets=SHARE_BUCKETS, registry=r)
        self.meeting_point = Histogram("cacheflow_restore_meeting_point", "Per restore and stage, where the "
                                       "pointers met: the share of units the compute side claimed from the front "
                                       "(loads that missed and were recomputed not counted)", ["stage"],
                                       buckets=SHARE_BUCKETS, registry=r)
        self.stage_units = Counter("cacheflow_stage_restore_units", "Restore units per stage and request class "
                                   "(the policy it restored with), by the side the batch scheduler gave them to "
                                   "(computed, loaded, missed: given to I/O, then recomputed)",
                                   ["stage", "policy", "how"], registry=r)
        self.unused_bytes = Counter("cacheflow_stage_unused_bytes", "Bytes a stage loaded that no unit kept (a "
                                    "load that missed after reading part of its unit)", ["stage"], registry=r)
        self._time_saved_metrics(r)

    def _time_saved_metrics(self, r: CollectorRegistry) -> None:
        """Restores against the profile's prediction of recomputing the whole prefix (every stage in turn); the
        time saved is the difference of the two counters' rates. Restores on unprofiled stages are not counted."""
        self.recompute_predicted = Counter("cacheflow_restore_recompute_predicted_seconds", "Predicted seconds to "
                                           "recompute the prefixes restored instead (profiled stages)", registry=r)
        self.restore_profiled = Counter("cacheflow_restore_profiled_seconds", "Seconds those restores took (the "
                                        "slowest stage's)", registry=r)
        self.time_share = Histogram("cacheflow_restore_time_share", "Per restore, its time over the predicted time "
                                    "to recompute its prefix (below 1: time saved)", buckets=TIME_SHARE_BUCKETS,
                                    registry=r)

    def declare(self, stages: int, pods: list[str]) -> None:
        """Export every stage's and pod's series from start-up (0 until something happens)."""
        for s in range(stages):
            stage = str(s)
            for what in STAGE_FAILURES:
                self.failures.labels(f"stage{s}:{what}")
            for series in (self.stage_busy, self.stage_loaded_bytes, self.unused_bytes):
                series.labels(stage)
            for mode in ("token", "layer"):
                self.stage_restores.labels(stage, mode)
            for how in ("computed", "loaded", "missed"):
                for policy in POLICIES:
                    self.stage_units.labels(stage, policy, how)
            self.loaded_share.labels(stage)
            self.meeting_point.labels(stage)
        for pod in pods:
            self.pod_up.labels(pod)

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
                self._record_shape(stage, summary, units)
            for cause, count in summary.misses.items():
                self.misses.labels(cause).inc(count)
            self.unused_bytes.labels(stage).inc(summary.bytes_unused)
        if stages and all(s.predicted_recompute_s > 0 for s in stages):
            predicted, took = sum(s.predicted_recompute_s for s in stages), max(s.elapsed_s for s in stages)
            self.recompute_predicted.inc(predicted)
            self.restore_profiled.inc(took)
            self.time_share.observe(took / predicted)

    def _record_shape(self, stage: str, summary: RestoreSummary, units: int) -> None:
        missed = min(sum(summary.misses.values()), summary.computed)
        self.loaded_share.labels(stage).observe(summary.loaded / units)
        self.meeting_point.labels(stage).observe((summary.computed - missed) / units)
        for how, count in (("computed", summary.computed - missed), ("loaded", summary.loaded), ("missed", missed)):
            self.stage_units.labels(stage, summary.policy, how).inc(count)

    def restore_modes(self, stage: int) -> dict[str, int]:
        """How many restores `stage` ran in each mode so far."""
        return {sample.labels["mode"]: int(sample.value) for metric in self.stage_restores.collect()
                for sample in metric.samples
                if sample.name.endswith("_total") and sample.labels["stage"] == str(stage)}
