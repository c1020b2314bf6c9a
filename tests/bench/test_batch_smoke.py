"""The batch benchmark runs end to end (quick settings: a few short trace requests on real processes)."""

from __future__ import annotations

import json

from cacheflow_bench import batch
from cacheflow_services.demo.run import SLICE

POLICIES = ("compute-only", "load-only", "cake", "cacheflow")


def test_batch_benchmark_quick_run(tmp_path):
    # the demo's shipped slice: quicker to read than the whole trace in bench/traces
    args = ["--quick", "--trace", str(SLICE), "--policies", ",".join(POLICIES), "--out", str(tmp_path)]
    (tmp_path / "batch.json").write_text(json.dumps({"summary": {"sweep_worst_mean_ratio_vs_cake": 0.5, "batch": 2}}))
    assert batch.main(args) == 0
    body = json.loads((tmp_path / "batch.json").read_text())
    summary = body["summary"]
    assert summary["sweep_worst_mean_ratio_vs_cake"] == 0.5  # the trace sweep's keys are kept, the rest rewritten
    assert summary["batch"] == 8
    assert summary["p99_ratio_vs_cake_b8"] > 0 and summary["mean_speedup_vs_compute_only_b8"] > 0
    assert summary["mean_ratio_vs_best_baseline_b8"] > 0 and summary["batched_forward_speedup"] > 0
    assert summary["sim_mean_rel_error"] >= 0 and summary["run_max_rel_spread"] == 0  # one run: no spread
    assert {(r["batch"], r["policy"]) for r in body["runs"]} == {
        (b, p) for b in (2, 8) for p in POLICIES} | {(8, p) for p in batch.RANKINGS}
    for run in body["runs"]:
        assert len(run["requests"]) == len(body["requests"]) == 4
        assert all(r["ttft_s"] > 0 for r in run["requests"])
        # compute-only is vLLM on a miss: the whole prompt prefilled, nothing restored; the others restore
        assert all((r["restored"] == 0) == (run["policy"] == "compute-only") for r in run["requests"])
        assert 0 < run["compute_busy_share"] <= 1 and 0 <= run["io_busy_share"] <= 1
        if run["policy"] == "load-only":  # storage holds every chunk: nothing is recomputed
            assert all(sum(r["units_computed"]) == 0 < sum(r["units_loaded"]) for r in run["requests"])
    assert body["calibration"]["slowdown"] >= 1
    assert [b["batch"] for b in body["bounds"]] == [2, 8]
    for bound in body["bounds"]:
        assert bound["bound_mean_s"] > 0 and bound["bound_max_s"] > 0
        assert set(bound["policies"]) == {p for b, p in ((r["batch"], r["policy"]) for r in body["runs"])
                                          if b == bound["batch"]}
    assert summary["mean_over_bound_cacheflow_b8"] > 0 and summary["max_over_bound_cake_b8"] > 0
    assert {r["tio_over_tcomp"] for r in body["cluster_scale"]} == {2.0, 1.0, 0.5}
    assert body["link"]["emulated"] is True
    md = (tmp_path / "batch.md").read_text()
    assert md.startswith("# Batch restore") and "emulated" in md and "Baselines" in md and "batch bound" in md
    assert (tmp_path / "batch.png").stat().st_size > 0
