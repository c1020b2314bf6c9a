"""`cacheflow demo` end to end on the tiny model and a short slice of the shipped trace (real processes)."""

from __future__ import annotations

import json

from cacheflow_common.sim.replay import load_slice
from cacheflow_services.cli import main
from cacheflow_services.demo.run import POLICIES, SLICE


def test_the_shipped_slice_keeps_what_the_trace_cached():
    records = load_slice(SLICE)
    assert len(records) == 100 and records[0].request.request_id == "3000"
    assert any(r.request.cached_tokens > 0 for r in records)  # the cache lines 0-2999 left
    assert all(r.request.cached_tokens <= r.request.input_length for r in records)


def test_demo_replays_every_policy_and_writes_its_report(tmp_path, monkeypatch):
    monkeypatch.setenv("CACHEFLOW_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "report"
    assert main(["demo", "--model", "tiny", "--requests", "3", "--max-tokens", "512", "--chunk-size", "64",
                 "--out", str(out)]) == 0
    body = json.loads((out / "demo.json").read_text())
    assert [r["policy"] for r in body["runs"]] == list(POLICIES)
    for run in body["runs"]:
        assert len(run["requests"]) == 3
        assert all(r["ttft_s"] > 0 for r in run["requests"])
        restored = [r["restored"] for r in run["requests"]]
        assert all(n >= 128 for n in restored)  # every request restored at least two chunks from storage
    report = (out / "demo.md").read_text()
    assert all(f"| {p} |" in report for p in POLICIES)
    assert (out / "demo.png").stat().st_size > 0
    assert body["link_gbps_per_pod"] > 0
