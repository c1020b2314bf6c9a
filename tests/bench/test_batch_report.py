"""The batch benchmark's summary over repeated runs: medians per batch size and policy, their range,
and the runs repeated after a failure."""

from __future__ import annotations

from typing import Any

import pytest

from cacheflow_bench.batch_report import _failures, aggregate, summary_of


def _run(batch: int, policy: str, mean: float, p99: float, failed: str = "", repeat: int = 0) -> dict[str, Any]:
    return {"batch": batch, "policy": policy, "repeat": repeat, "mean_s": mean, "p50_s": mean, "p90_s": p99,
            "p99_s": p99, "failed_first_try": failed, "requests": []}


RUNS = [_run(8, "cake", 2.0, 4.0), _run(8, "cake", 3.0, 5.0, repeat=1), _run(8, "cake", 2.5, 9.0, repeat=2),
        _run(8, "cacheflow", 2.0, 3.0), _run(8, "cacheflow", 2.2, 3.5, "HTTP 502: stage 1 failed", repeat=1),
        _run(8, "compute-only", 6.0, 12.0), _run(2, "cake", 1.0, 2.0)]


def test_each_batch_and_policy_is_the_median_of_its_runs_with_their_range():
    cake = next(r for r in aggregate(RUNS) if (r["batch"], r["policy"]) == (8, "cake"))
    assert cake["repeats"] == 3 and cake["mean_s"] == 2.5 and cake["p99_s"] == 5.0
    assert (cake["mean_s_min"], cake["mean_s_max"], cake["p99_s_min"], cake["p99_s_max"]) == (2.0, 3.0, 4.0, 9.0)


def test_the_summary_compares_medians_at_the_largest_batch_and_counts_repeated_runs():
    errors = [{"max_rel_error": 0.5, "median_rel_error": 0.2, "mean_rel_error": 0.1, "run_max_rel_spread": 1.0,
               "run_median_rel_spread": 0.1}]
    s = summary_of(RUNS, errors)
    assert s["batch"] == 8 and s["p99_ratio_vs_cake_b8"] == pytest.approx(3.25 / 5.0)
    assert s["best_baseline_b8"] == "cake" and s["mean_ratio_vs_best_baseline_b8"] == pytest.approx(2.1 / 2.5)
    assert s["mean_speedup_vs_compute_only_b8"] == pytest.approx(6.0 / 2.1) and s["runs_repeated_after_a_failure"] == 1
    assert _failures(RUNS)[2] == "* batch 8, cacheflow, run 2: HTTP 502: stage 1 failed"
