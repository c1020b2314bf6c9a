"""The simulated trace sweep runs on disjoint windows and reports every policy against Cake and the batch
bound, which no simulated policy beats (simulated: no processes)."""

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


def test_windows_never_share_a_trace_line() -> None:
    wins = sweep.windows(sweep.TRACE, 3000, 3, 5)
    lines = [int(r.trace.request_id) for w in wins for r in w]
    assert len(wins) == 3 and lines == sorted(set(lines))
