"""`cacheflow bench report` builds REPORT.md and every figure from the benchmarks' committed results."""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from cacheflow_bench import report
from cacheflow_bench.common import RESULTS_DIR, SCRATCH_DIR, results_dir


def test_report_from_the_committed_results_has_every_figure(tmp_path):
    for name in report.SUITE:
        shutil.copy(RESULTS_DIR / f"{name}.json", tmp_path)
    assert report.main(["--out", str(tmp_path)]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    for fig in ("fig4_ttft_cdf", "fig5_utilization", "fig6_by_length", "fig7_ablation", "fig7ab_link_sweep",
                "fig9_batch_sizes"):
        assert f"({fig}.png)" in text
        assert (tmp_path / f"{fig}.png").stat().st_size > 0
    assert "Missing" not in text
    assert "## Storage data plane" in text and "## Parallel stages" in text and "## vLLM connector" in text


def test_a_benchmark_not_run_is_listed_as_missing(tmp_path):
    shutil.copy(RESULTS_DIR / "storage.json", tmp_path)
    assert report.main(["--out", str(tmp_path)]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    assert "Missing: run `cacheflow bench batch`." in text and "Missing: run `cacheflow bench restore`." in text
    assert not (tmp_path / "fig4_ttft_cdf.png").exists()


def scale_row(batch: int, policy: str, mean_s: float) -> dict[str, float | int | str]:
    return {"batch": batch, "policy": policy, "tio_over_tcomp": 1.0, "mean_s": mean_s, "p99_s": 2 * mean_s}


def test_the_report_says_when_the_simulated_batch_cap_never_binds():
    flat = [scale_row(b, p, m) for b in (8, 64) for p, m in (("cake", 1.0), ("cacheflow", 1.2))]
    assert report.cap_never_binds(flat)
    assert not report.cap_never_binds([*flat[:-1], scale_row(64, "cacheflow", 0.9)])
    assert not report.cap_never_binds([r for r in flat if r["batch"] == 8])  # one cap: nothing to compare


def test_recorded_commands_read_as_the_user_typed_them(monkeypatch):
    from cacheflow_bench.common import command_line

    monkeypatch.setattr("sys.argv", ["/usr/local/bin/cacheflow", "bench", "batch", "--quick"])
    assert command_line() == "cacheflow bench batch --quick"
    monkeypatch.setattr("sys.argv", ["/work/main/bench/vllm.py", "--quick"])
    assert command_line() == "python -m cacheflow_bench.vllm --quick"


def test_results_of_quick_runs_are_refused_unless_the_report_is_a_smoke_report(tmp_path, capsys):
    body = json.loads((RESULTS_DIR / "storage.json").read_text())
    (tmp_path / "storage.json").write_text(json.dumps({**body, "quick": True}))
    shutil.copy(RESULTS_DIR / "stages.json", tmp_path)
    assert report.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"storage.json in {tmp_path} come from --quick runs" in err
    assert "stages.json" not in err and not (tmp_path / "REPORT.md").exists()
    assert report.main(["--out", str(tmp_path), "--quick"]) == 0
    assert "Smoke report (`--quick`)" in (tmp_path / "REPORT.md").read_text()


@pytest.mark.parametrize("name", ["restore_single", "storage", "stages", "batch", "vllm"])
def test_quick_runs_write_to_the_scratch_folder_unless_told_otherwise(name, capsys, monkeypatch):
    module = importlib.import_module(f"cacheflow_bench.{name}")
    if name == "vllm":  # its parser insists on vLLM's virtual environment
        monkeypatch.setattr(module, "VLLM_PYTHON", Path(sys.executable))
    assert results_dir(module.parse_args(["--quick"])) == SCRATCH_DIR
    assert f"--quick: results go to {SCRATCH_DIR}" in capsys.readouterr().out
    assert results_dir(module.parse_args([])) == RESULTS_DIR
    assert results_dir(module.parse_args(["--quick", "--out", "elsewhere"])) == Path("elsewhere")
