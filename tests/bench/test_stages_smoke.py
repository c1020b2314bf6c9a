"""The stage benchmark end to end (quick settings, real processes), checked by invariants: stage 0 needs no
boundary activation, S = 2 stores and reads them, both splits store the same KV. No timings."""

from __future__ import annotations

import json

from cacheflow_bench import parallel_stages


def test_stage_benchmark_quick_run(tmp_path):
    assert parallel_stages.main(["--quick", "--model", "tiny", "--stages", "1,2", "--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "stages.json").read_text())
    summary = body["summary"]
    assert summary["speedup_s2_vs_pipelined"] > 0 and 0 < summary["boundary_bytes_share"] < 1
    s1, s2 = body["rows"]
    assert [s1["stages"], s2["stages"]] == [1, 2]
    assert s1["boundary_bytes_stored"] == s1["boundary_bytes_read"] == 0  # one stage starts from the tokens
    assert s2["boundary_bytes_stored"] > 0 and s2["boundary_bytes_read"] > 0  # stage 1 restarts from them
    assert 1 <= s2["kv_bytes_stored"] / s1["kv_bytes_stored"] < 1.05  # the same KV, a header per stage's chunk
    assert set(s2["times_s"]) == {"boundary", "pipelined", "sequential"}
    assert body["setup"]["link"]["emulated"] is True
    md = (tmp_path / "stages.md").read_text()
    assert md.startswith("# Stages") and "emulated" in md
    assert (tmp_path / "stages.png").stat().st_size > 0
