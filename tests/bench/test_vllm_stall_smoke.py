"""The stall benchmark end to end on real vLLM (CPU) processes, TP 1 and a short prefix, checked by invariants:
the restored request arrived while the others decoded (each had its tokens before it came), every column was
measured, the connector's columns restored it (in the background, or inside vLLM's step), and its first token
is vLLM's own. No timings."""

from __future__ import annotations

import json

import pytest

from cacheflow_bench import vllm, vllm_stall

pytestmark = pytest.mark.skipif(not vllm.VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")


def test_vllm_stall_bench_invariants(tmp_path):
    work = tmp_path / "work"
    assert vllm_stall.main(["--quick", "--out", str(tmp_path), "--workdir", str(work)]) == 0
    body = json.loads((tmp_path / "vllm_stall.json").read_text())
    columns = body["columns"]["1"]
    assert set(columns) == set(vllm_stall.COLUMNS)
    for name, column in columns.items():
        assert column["stall_s"] >= column["median_gap_s"] > 0 and column["late_ttft_s"] > 0, name
        results = json.loads((work / f"stall-tp1-{name}.out.json").read_text())["results"]
        for start in range(0, len(results), vllm_stall.DECODERS + 1):
            *decoders, late = results[start : start + vllm_stall.DECODERS + 1]
            assert all(len(r["tokens"]) == vllm_stall.DECODE_TOKENS for r in (*decoders, late))
            assert late["submitted_s"] >= max(r["token_times_s"][vllm_stall.LATE_AFTER - 1] for r in decoders)
    assert body["summary"]["next_token_matches"] is True
    for name, asynchronous in (("background", True), ("in-step", False)):
        restores = columns[name]["restores"]
        assert len(restores) == 2 and all(r["asynchronous"] is asynchronous for r in restores), name  # warm-up too
        assert all(r["computed"] + r["loaded"] > 0 and not r["misses"] for r in restores), name
    table = (tmp_path / "vllm_stall.md").read_text()
    assert "longest gap" in table
    for name in ("background", "in-step"):
        measured = columns[name]["restores"][1]  # the warm-up batch's restore is left out of the plans
        assert f"| {name} |" in table and vllm_stall.measured_plans(columns[name]["restores"]) == \
            f"{measured['computed']}/{measured['loaded']}"
