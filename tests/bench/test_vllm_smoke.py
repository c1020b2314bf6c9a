"""The vLLM benchmark end to end on real vLLM (CPU) processes, one short prefix at one ratio, checked by
invariants: every column measured, the greedy next token of every connector policy equals vLLM's own
recompute, every connector column restored (load-only computed nothing, compute-only loaded nothing), and
no restore missed. vLLM's default token budget alone (the full run also tries one that prefills a whole prompt in
one step: the same code, one more vLLM process per mode). No timings."""

from __future__ import annotations

import json

import pytest

from cacheflow_bench import vllm, vllm_batch, vllm_trace

pytestmark = pytest.mark.skipif(not vllm.VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")


def test_budgets_are_parsed_or_refused(capsys):
    assert vllm.parse_args(["--budgets", "default,16384"]).budgets == (None, 16384)
    assert vllm.parse_args([]).budgets == (None, 16384)
    for bad in ("", "0", "default,fast"):
        with pytest.raises(SystemExit):
            vllm.parse_args(["--budgets", bad])
        assert "--budgets" in capsys.readouterr().err


def test_vllm_bench_invariants(tmp_path):
    assert vllm.main(["--lengths", "512", "--ratios", "1", "--batch-prefixes", "256,512", "--trace-requests", "2",
                      "--loads", "medium", "--budgets", "default", "--out", str(tmp_path),
                      "--workdir", str(tmp_path / "work")]) == 0
    body = json.loads((tmp_path / "vllm.json").read_text())
    [row] = body["rows"]
    for column in ("recompute_s", "own-recompute_s", *(f"{p}_s" for p in vllm.POLICIES)):
        assert row[column] > 0, column
    assert set(row["recompute_by_budget_s"]) == {"default"} and row["link_emulated"] is True
    assert body["summary"]["next_token_matches_vllm"] is True
    assert {"cacheflow_vs_cake_median", "cacheflow_vs_cake_min"} <= set(body["summary"])
    batch = body["batch"]
    assert set(batch["columns"]) == {"recompute", *vllm_batch.COLUMNS}
    for name, column in batch["columns"].items():
        assert len(column["ttft_s"]) == batch["repeats"] and all(len(r) == 2 for r in column["ttft_s"]), name
    assert body["summary"]["vllm_batch_next_token_matches"] is True
    recompute = body["recompute"]
    assert set(recompute["runs"]) == {"budget-default", "runtime-cacheflow"}
    for run in recompute["runs"].values():  # each connector request split into its restore and the rest
        assert all(0 < t["restore"] < t["connector"] and t["rest"] > 0 for t in run.values()), run
    assert body["summary"]["connector_recompute_restores_happened"] is True
    trace = body["trace"]
    assert set(trace["columns"]) == set(vllm_trace.COLUMNS) and len(trace["requests"]) == 2
    assert all(list(c["by_rate"]) == ["medium"] for c in trace["columns"].values())
    assert all(len(r["ttft_s"]) == 2 and min(r["ttft_s"]) > 0 and r["throughput_rps"] > 0
               for c in trace["columns"].values() for r in c["by_rate"].values())
    assert body["summary"]["vllm_rate_sweep_next_token_matches"] is True
    assert body["summary"]["vllm_rate_sweep_restores_happened"] is True
    assert (tmp_path / "vllm_rates.png").stat().st_size > 0
    restores = body["restores"]
    assert {r["policy"] for r in restores} == {"compute-only", *vllm.POLICIES}
    batched = [r for r in restores if r["batch"] > 1]  # the batch columns' restores, two at a time
    assert batched and all(r["batch"] == 2 for r in batched)
    for r in restores:
        assert r["misses"] == {}, r
        assert r["computed"] + r["loaded"] > 0
        if r["policy"] == "load-only":
            assert r["computed"] == 0, r
        if r["policy"] == "compute-only":
            assert r["loaded"] == 0 and r["bytes_loaded"] == 0, r
    md = (tmp_path / "vllm.md").read_text()
    assert "CacheFlow / Cake" in md and "emulated" in md and all(
        f"## {mode}" in md for mode in ("Recompute", "Batch", "Serving"))
