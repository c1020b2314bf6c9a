"""The stage benchmark runs end to end (quick settings, real processes) and writes its summary."""

from __future__ import annotations

import json

from cacheflow_bench import stages


def test_stage_benchmark_quick_run(tmp_path):
    assert stages.main(["--quick", "--model", "tiny", "--stages", "1,2", "--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "stages.json").read_text())
    summary = body["summary"]
    assert summary["speedup_s2_vs_pipelined"] > 0 and 0 < summary["boundary_bytes_share"] < 1
    assert [r["stages"] for r in body["rows"]] == [1, 2]
    assert (tmp_path / "stages.md").read_text().startswith("# Stages")
    assert (tmp_path / "stages.png").stat().st_size > 0
