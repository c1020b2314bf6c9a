"""A worker's utilisation metrics: the share of a recent window a resource was busy, from its intervals."""

from __future__ import annotations

import pytest

from cacheflow_services.worker.metrics import BusyShare, WorkerMetrics


def test_the_busy_share_counts_only_the_window_and_clips_an_interval_at_its_edge():
    meter = BusyShare(window_s=10.0)
    meter.add(4.0, end=100.0)  # busy [96, 100]
    meter.add(2.0, end=93.0)  # busy [91, 93]
    assert meter.share(now=100.0) == pytest.approx(0.6)
    assert meter.share(now=102.0) == pytest.approx((1.0 + 4.0) / 10.0)  # window [92, 102]: [92, 93] is left
    assert meter.share(now=200.0) == 0.0 and meter.total_s == 6.0  # the totals keep everything


def test_steps_and_loads_add_up_in_the_totals_the_benchmark_reads():
    metrics = WorkerMetrics(n_channels=2)
    metrics.step(0.5, tokens=128, requests=4)
    metrics.channel_busy(1, 0.25)
    totals = metrics.busy_totals()
    assert totals["compute_s"] == 0.5 and totals["channels_s"] == [0.0, 0.25] and totals["uptime_s"] > 0
