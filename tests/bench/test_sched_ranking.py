"""The channel-ranking study runs and reports every cell (simulated: no processes)."""

from __future__ import annotations

import json
from pathlib import Path

from cacheflow_bench import sched_ranking


def test_sched_ranking_reports_every_cell(tmp_path: Path) -> None:
    assert sched_ranking.main(["--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "sched_ranking.json").read_text())
    assert body["summary"]["cells"] == len(body["rows"]) == 9
    for row in body["rows"]:
        assert row["requests"] > 10
        # restoring from storage beats recomputing everything whatever the ranking
        assert all(row[f"{p}_mean_s"] < row["compute-only_mean_s"] for p in sched_ranking.RANKINGS)
    assert set(body["summary"]["better_cells"]) == set(sched_ranking.RANKINGS) - {"cake"}
    assert "| arrival scale |" in (tmp_path / "sched_ranking.md").read_text()
