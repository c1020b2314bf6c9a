"""The restore benchmark's code path end to end (quick mode): every policy, the bound and the summary."""

from __future__ import annotations

import json

from cacheflow_bench import restore_single


def test_quick_run_writes_every_policy_and_the_summary(tmp_path):
    assert restore_single.main(["--quick", "--lengths", "256,512", "--ratios", "1", "--chunk-size", "128",
                                "--out", str(tmp_path)]) == 0
    body = json.loads((tmp_path / "restore_single.json").read_text())
    assert body["quick"] is True  # `cacheflow bench report` refuses it
    assert {"max_ratio_to_bound", "ratio_to_best_baseline_at_balance", "max_adaptive_regret"} <= set(body["summary"])
    assert len(body["cells"]) == 2
    for cell in body["cells"]:
        assert set(cell["times_s"]) == set(restore_single.POLICIES)
        assert cell["bound_s"] > 0 and cell["bound_s"] <= min(cell["times_s"]["compute-only"],
                                                                cell["times_s"]["load-only"]) * 1.5
    assert (tmp_path / "restore_single.md").read_text().count("| tiny |") == 2
    assert (tmp_path / "restore_single.png").stat().st_size > 0
