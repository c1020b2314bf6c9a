"""What a simulation reports: per request timings and sources, per resource busy time, and a summary."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RequestResult:
    request_id: str
    mode: str  # "token" | "layer"
    arrival_s: float
    queue_s: float  # waiting for a restore slot (max batch)
    restore_s: float  # admitted until its pointers met on every stage
    ttft_s: float  # arrival until the suffix prefill left the last stage
    cached_tokens: int
    tokens_computed: float  # prefix tokens' worth of KV (over all layers) recomputed
    tokens_loaded: float  # ... and loaded; the two add up to cached_tokens (layer mode: more on misses)


@dataclass(frozen=True, kw_only=True)
class SimResult:
    policy: str
    requests: tuple[RequestResult, ...]
    stage_busy_s: tuple[float, ...]  # per stage: seconds running compute batches
    channel_busy_s: tuple[float, ...]  # per channel: seconds serving loads
    makespan_s: float  # first arrival to last event

    def stage_utilization(self) -> list[float]:
        return [busy / self.makespan_s if self.makespan_s else 0.0 for busy in self.stage_busy_s]

    def channel_utilization(self) -> list[float]:
        return [busy / self.makespan_s if self.makespan_s else 0.0 for busy in self.channel_busy_s]

    def summary(self) -> dict[str, float]:
        ttft = sorted(r.ttft_s for r in self.requests)
        computed = sum(r.tokens_computed for r in self.requests)
        loaded = sum(r.tokens_loaded for r in self.requests)
        return {
            "requests": float(len(self.requests)),
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else 0.0,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90),
            "ttft_p99_s": percentile(ttft, 99),
            "restore_mean_s": _mean([r.restore_s for r in self.requests]),
            "computed_fraction": computed / (computed + loaded) if computed + loaded else 0.0,
            "stage_utilization": _mean(self.stage_utilization()),
            "channel_utilization": _mean(self.channel_utilization()),
            "makespan_s": self.makespan_s,
        }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile of sorted values, interpolating linearly between closest ranks (0.0 if empty)."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
