"""The trace sweep runs on disjoint windows and reports every policy against Cake and the batch bound: in the
simulator (no processes), where no policy beats the bound, and on the local cluster (real processes)."""

from __future__ import annotations

import json
from pathlib import Path

from cacheflow_bench import sweep

PROFILE = Path(__file__).resolve().parents[2] / "bench" / "results" / "sweep_sim_profile.json"


def test_sweep_reports_every_window_level_and_policy(tmp_path: Path) -> None:
    assert sweep.main(["--sim-only", "--quick", "--profile", str(PROFILE), "--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "sweep_sim.json").read_text())
    assert body["windows"] == 2 and len(body["rows"]) == 2 * len(sweep.LEVELS)
    assert set(body["summary"]) == set(sweep.LEVELS)
    for row in body["rows"]:
        for policy in body["policies"]:
            assert row["bound"]["mean_s"] <= row[policy]["mean_s"] + 1e-9
            assert row["bound"]["max_s"] <= row[policy]["max_s"] + 1e-9
    assert body["summary"]["medium"]["cake"]["mean_vs_cake_max"] == 1.0
    assert "| cacheflow-saving |" in (tmp_path / "sweep_sim.md").read_text()
    assert (tmp_path / "sweep_sim.png").stat().st_size > 0
    assert set(body["headline"]) == {"sweep_worst_mean_ratio_vs_cake", "sweep_worst_max_ratio_vs_cake",
                                     "sweep_light_worst_mean_ratio_vs_cake", "sweep_overload_median_mean_ratio_vs_cake",
                                     "sweep_overload_median_mean_ratio_vs_bound"}
    assert not (tmp_path / "batch.json").exists()  # a simulated sweep leaves the batch results alone


def test_cluster_sweep_replays_every_cell_and_joins_the_batch_results(tmp_path: Path) -> None:
    (tmp_path / "batch.json").write_text(json.dumps({"summary": {"batch": 8, "sweep_stale": 1.0}}))
    assert sweep.main(["--quick", "--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "sweep.json").read_text())
    assert body["simulated"] is False and body["policies"] == list(sweep.CLUSTER_POLICIES)
    assert {(r["window"], r["level"]) for r in body["rows"]} == {(w, lv) for w in range(2) for lv in sweep.LEVELS}
    for row in body["rows"]:
        for policy in body["policies"]:
            cell = row[policy]
            assert len(cell["ttft_s"]) == len(cell["sim_ttft_s"]) == 6 and min(cell["ttft_s"]) > 0
            assert cell["sim_mean_rel_error"] >= 0 and cell["max_s"] >= cell["mean_s"]
        assert row["bound"]["mean_s"] > 0 and row["bound"]["max_s"] > 0
    merged = json.loads((tmp_path / "batch.json").read_text())["summary"]
    assert merged["batch"] == 8 and "sweep_stale" not in merged
    assert merged["sweep_worst_max_ratio_vs_cake"] == body["headline"]["sweep_worst_max_ratio_vs_cake"]
    assert "sweep_sim_mean_rel_error" in merged
    assert (tmp_path / "sweep.md").read_text().startswith("# Trace sweep (local cluster")


def test_windows_never_share_a_trace_line() -> None:
    wins = sweep.windows(sweep.TRACE, 3000, 3, 5)
    lines = [int(r.trace.request_id) for w in wins for r in w]
    assert len(wins) == 3 and lines == sorted(set(lines))
