"""`cacheflow bench report` builds REPORT.md and every figure from the benchmarks' committed results."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from cacheflow_bench import readme_table, report
from cacheflow_bench.common import RESULTS_DIR, SCRATCH_DIR, results_dir


@pytest.mark.parametrize("name", report.SUITE)
def test_every_benchmark_of_the_suite_has_a_module_to_run(name):
    assert callable(report.benchmark_module(name).main)


def test_report_from_the_committed_results_has_every_figure(tmp_path):
    for name in report.SUITE:
        shutil.copy(RESULTS_DIR / f"{name}.json", tmp_path)
    assert report.main(["--out", str(tmp_path), "--allow-mixed"]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    for fig in ("fig4_ttft_cdf", "fig5_utilization", "fig6_by_length", "fig7_ablation", "fig7ab_link_sweep",
                "fig9_batch_sizes"):
        assert f"({fig}.png)" in text
        assert (tmp_path / f"{fig}.png").stat().st_size > 0
    assert "Missing" not in text
    for title in ("Storage data plane", "Parallel stages", "Trace sweep", "Kills and abuse (chaos)", "vLLM connector"):
        assert f"## {title}" in text


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


@pytest.mark.parametrize("name", ["restore_single", "storage", "stages", "batch", "chaos", "vllm"])
def test_quick_runs_write_to_the_scratch_folder_unless_told_otherwise(name, capsys, monkeypatch):
    module = report.benchmark_module(name)
    if name == "vllm":  # its parser insists on vLLM's virtual environment
        monkeypatch.setattr(module, "VLLM_PYTHON", Path(sys.executable))
    assert results_dir(module.parse_args(["--quick"])) == SCRATCH_DIR
    assert f"--quick: results go to {SCRATCH_DIR}" in capsys.readouterr().out
    assert results_dir(module.parse_args([])) == RESULTS_DIR
    assert results_dir(module.parse_args(["--quick", "--out", "elsewhere"])) == Path("elsewhere")


def fake_results(folder: Path, commits: dict[str, str], summaries: dict[str, dict[str, float]] | None = None) -> None:
    """Copies of the committed results, each claiming the given commit (and these summary values)."""
    for name, commit in commits.items():
        body = json.loads((RESULTS_DIR / f"{name}.json").read_text())
        body["summary"] |= (summaries or {}).get(name, {})
        (folder / f"{name}.json").write_text(json.dumps({**body, "machine": {**body["machine"], "git": commit}}))


def test_results_of_different_commits_are_refused_unless_allowed_and_then_each_says_its_commit(tmp_path, capsys):
    fake_results(tmp_path, {"storage": "abc1234", "stages": "def5678", "chaos": "abc1234"})
    assert report.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "storage.json: abc1234, stages.json: def5678, chaos.json: abc1234" in err
    assert not (tmp_path / "REPORT.md").exists()
    assert report.main(["--out", str(tmp_path), "--allow-mixed"]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    assert "several commits" in text
    assert "## Storage data plane (commit abc1234)" in text and "## Parallel stages from boundary activations " \
        "(commit def5678)" in text and "## Kills and abuse (chaos) (commit abc1234)" in text
    assert "CPUs, commit def5678. Command:" in text


def test_results_of_one_commit_make_a_report_that_names_it(tmp_path):
    fake_results(tmp_path, {"storage": "abc1234", "stages": "abc1234"})
    assert report.main(["--out", str(tmp_path)]) == 0
    text = (tmp_path / "REPORT.md").read_text()
    assert "Every result comes from commit abc1234." in text
    assert "## Storage data plane\n" in text and "several commits" not in text


def test_results_of_uncommitted_code_are_refused_unless_allowed(tmp_path, capsys):
    fake_results(tmp_path, {"storage": "abc1234-dirty", "stages": "abc1234-dirty"})
    assert report.main(["--out", str(tmp_path)]) == 2
    assert "storage.json: abc1234-dirty, stages.json: abc1234-dirty" in capsys.readouterr().err
    assert report.main(["--out", str(tmp_path), "--allow-mixed"]) == 0
    assert "## Storage data plane (commit abc1234-dirty)" in (tmp_path / "REPORT.md").read_text()


def test_a_result_without_its_commit_is_refused(tmp_path, capsys):
    fake_results(tmp_path, {"storage": "", "stages": "abc1234"})
    assert report.main(["--out", str(tmp_path)]) == 2
    assert "storage.json: no commit recorded, stages.json: abc1234" in capsys.readouterr().err


README_AROUND = ("# Project\n\nProse before.\n\n", "\n\nProse after, with | a | table-like | line |.\n")


def test_the_readme_table_is_rewritten_between_its_markers_and_nothing_else(tmp_path):
    fake_results(tmp_path, {"storage": "abc1234", "stages": "abc1234", "batch": "abc1234"},
                 {"storage": {"loader_gb_per_s_tcp": 1.084}, "stages": {"speedup_s2_vs_s1": 1.478},
                  "batch": {"p99_ratio_vs_cake_b8": 1.16, "mean_ratio_vs_cake_b8": 0.909}})
    readme = tmp_path / "README.md"
    before, after = README_AROUND
    readme.write_text(f"{before}{readme_table.BEGIN}\n| old | hand-written | table |\n{readme_table.END}{after}")
    assert report.main(["--out", str(tmp_path), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith(before) and text.endswith(after) and "hand-written" not in text
    block = readme_table.current_block(text)
    assert ("| storage data plane (`cacheflow bench storage`) | one loader into a KV buffer, unshaped loopback, "
            "worst of 1–64 MB: TCP **1.08 GB/s**") in block
    assert "| parallel stages (`cacheflow bench stages`) | S = 2 from boundary activations vs S = 1: 1.48×" in block
    assert re.search(r"\*\*CacheFlow [0-9.]+ s\*\*, Cake [0-9.]+ s, load-only [0-9.]+ s, compute-only [0-9.]+ s", block)
    assert "CacheFlow / Cake: mean 0.909×, P99 1.16× (**CacheFlow does not beat Cake at P99**)" in block
    assert "cacheflow bench restore" not in block
    assert "Results of commit abc1234 (`cacheflow bench report --run`)." in block
    assert report.main(["--out", str(tmp_path), "--readme", str(readme)]) == 0
    assert readme.read_text() == text  # a second run changes nothing


def test_the_readme_table_says_n_a_for_keys_an_older_result_lacks_and_when_cacheflow_loses_to_cake():
    body = {"summary": {"cacheflow_vs_cake_at_balance": 1.04, "ratio_to_best_baseline_at_balance": 0.58,
                        "bound_spread": 0.21, "max_ratio_to_bound": 1.19, "within_bound_resolvable": False},
            "machine": {"git": "abc1234"}}
    row = readme_table.block({"restore_single": body})
    assert "CacheFlow / Cake **1.04** (**CacheFlow does not beat Cake**)" in row
    assert "not resolvable: T* itself varies by 0.21" in row
    assert "Cake / the same n/a (rerun `cacheflow bench restore`)" in row
    vllm = {"summary": {"cacheflow_vs_cake_median": 1.1, "cacheflow_vs_cake_min": 0.93}, "machine": {"git": "abc1234"}}
    assert "CacheFlow / Cake median **1.10×**, best 0.930× (**CacheFlow does not beat Cake at most points**)" in \
        readme_table.block({"vllm": vllm})


def test_the_readme_batch_row_carries_the_trace_sweep_only_where_batch_json_has_its_keys():
    body = {"summary": {"batch": 8}, "runs": [], "machine": {"git": "abc1234"}}
    assert "Trace sweep" not in readme_table.block({"batch": body})
    keys = {"sweep_worst_mean_ratio_vs_cake": 1.05, "sweep_worst_max_ratio_vs_cake": 1.06,
            "sweep_light_worst_mean_ratio_vs_cake": 1.03, "sweep_overload_median_mean_ratio_vs_cake": 0.95,
            "sweep_overload_median_mean_ratio_vs_bound": 3.4, "sweep_sim_mean_rel_error": 0.4}
    row = readme_table.block({"batch": {**body, "summary": {"batch": 8, **keys}}})
    assert "CacheFlow / Cake worst mean 1.05× and worst slowest request 1.06×" in row
    assert "overload median ≤ 0.85× and ≤ 1.15× the bound" in row


def test_the_readme_is_left_alone_for_results_outside_the_committed_folder(tmp_path, monkeypatch):
    fake_results(tmp_path, {"storage": "abc1234"})
    monkeypatch.setattr(readme_table, "README", tmp_path / "missing-README.md")  # touching it would fail
    assert report.main(["--out", str(tmp_path)]) == 0
    assert report.readme_path(report.parse_args(["--quick", "--out", str(RESULTS_DIR)]), RESULTS_DIR) is None
    assert report.readme_path(report.parse_args([]), RESULTS_DIR) == tmp_path / "missing-README.md"


def test_the_committed_readme_table_is_the_one_the_committed_results_give():
    """A README whose table disagrees with bench/results/*.json fails here: rerun `cacheflow bench report`."""
    expected = readme_table.block(report.load_results(RESULTS_DIR))
    assert readme_table.current_block(readme_table.README.read_text()) == expected


def test_run_on_uncommitted_code_is_refused_before_any_benchmark_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "machine_facts", lambda: {"git": "abc1234-dirty"})
    monkeypatch.setattr(report, "run_suite", lambda out, quick: pytest.fail("the suite ran on uncommitted code"))
    assert report.main(["--run", "--out", str(tmp_path)]) == 2
    assert "commit it first" in capsys.readouterr().err


def test_run_passes_the_published_settings(tmp_path, monkeypatch):
    seen: dict[str, list[str]] = {}

    class Bench:
        def __init__(self, name: str) -> None:
            self.name = name

        def main(self, argv: list[str]) -> int:
            seen[self.name] = argv
            return 0

    monkeypatch.setattr(importlib, "import_module", lambda name: Bench(name.rsplit(".", 1)[1]))
    report.run_suite(tmp_path, quick=False)
    assert seen["restore_single"] == ["--out", str(tmp_path), *report.PUBLISHED["restore_single"]]
    assert seen["batch"] == ["--out", str(tmp_path)]


def test_the_before_and_after_section_sets_an_earlier_commits_headlines_beside_todays():
    from cacheflow_bench import before_after

    earlier = {"rev": "abc1234", "commits": {"batch": "abc1234"},
               "before": {"batch:calibration.slowdown": 2.9, "batch:summary.mean_ratio_vs_cake_b8": 0.95}}
    now = {"batch": {"calibration": {"slowdown": 1.2}, "summary": {"mean_ratio_vs_cake_b8": 0.9}}}
    lines = "\n".join(before_after.section(now, earlier))
    assert "| compute slowdown while loading (calibrated) | 2.900 | abc1234 | 1.200 |" in lines
    assert "| batch 8: CacheFlow / Cake, mean TTFT | 0.950 | abc1234 | 0.900 |" in lines
    assert "| vLLM serving: worst P99 vs best baseline | - | ? | - |" in lines  # neither has it
