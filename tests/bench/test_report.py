"""`cacheflow bench report` builds REPORT.md and every figure from the benchmarks' committed results."""

from __future__ import annotations

import shutil

from cacheflow_bench import report
from cacheflow_bench.common import RESULTS_DIR


def test_report_from_the_committed_results_has_every_figure(tmp_path):
    for name in report.SUITE:
        shutil.copy(RESULTS_DIR / f"{name}.json", tmp_path)
    assert report.main(["--out", str(tmp_path)]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    for fig in ("fig4_ttft_cdf", "fig6_by_length", "fig7_ablation", "fig7ab_link_sweep", "fig9_batch_sizes"):
        assert f"({fig}.png)" in text
        assert (tmp_path / f"{fig}.png").stat().st_size > 0
    assert "Missing" not in text.replace("Missing: rerun `cacheflow bench batch` (older results).", "")
    assert "## Storage data plane" in text and "## Parallel stages" in text


def test_a_benchmark_not_run_is_listed_as_missing(tmp_path):
    shutil.copy(RESULTS_DIR / "storage.json", tmp_path)
    assert report.main(["--out", str(tmp_path)]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    assert "Missing: run `cacheflow bench batch`." in text and "Missing: run `cacheflow bench restore`." in text
    assert not (tmp_path / "fig4_ttft_cdf.png").exists()
