"""The scheduler scale benchmark end to end (quick settings, into a temporary folder), its comparison with a
baseline run, its growth fit; and its workloads decided alike by the scheduler and the oracle (the
scheduler before its incremental state). No timings are checked."""

from __future__ import annotations

import copy
import json

import pytest

from cacheflow_bench import sched_scale
from cacheflow_bench.sched_scale_drive import drive
from cacheflow_bench.sched_scale_report import compare, growth_exponent, summarize
from cacheflow_common.sched import POLICIES
from tests.common.sched_oracle import BatchScheduler as OracleScheduler


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sched_scale")
    assert sched_scale.main(["--quick", "--out", str(out)]) == 0
    return out, json.loads((out / "sched_scale.json").read_text())


def test_a_quick_run_reports_every_cell_and_part(quick_run):
    out, body = quick_run
    assert {(r["policy"], r["restores"]) for r in body["cells"]} == {
        (p, n) for p in sched_scale.POLICIES_TIMED for n in (1, 8, 32)}
    for row in body["cells"]:
        assert row["compute_picks"] == 20 and row["channel_picks"] > 0 and not row["stopped_by_budget"]
        assert 0 < row["compute_ms"]["median"] <= row["compute_ms"]["p99"] <= row["compute_ms"]["worst"]
    assert {r["policy"] for r in body["fingerprints"]} == set(POLICIES)
    assert body["sim"]["requests"] == 300 and body["sim"]["wall_s"] > 0
    assert {(r["mode"], r["policy"]) for r in body["engine"]} == {
        (m, p) for m in ("worker (own loop thread)", "connector (caller's thread)") for p in sched_scale.POLICIES_TIMED}
    assert all(r["steps"] > 0 and 0 < r["sched_share"] < 1 for r in body["engine"])
    summary = body["summary"]
    assert summary["decisions_identical"] is None  # no baseline given
    assert set(summary["growth_exponents"]) == {f"{p}/16" for p in sched_scale.POLICIES_TIMED}
    assert (out / "sched_scale.md").read_text().startswith("# The batch scheduler at production batch sizes")
    assert (out / "sched_scale.png").stat().st_size > 0


def test_a_baseline_with_the_same_decisions_is_identical_and_one_decision_apart_is_not(quick_run):
    _, body = quick_run
    assert compare(body, body)["decisions_identical"]
    other = copy.deepcopy(body)
    row = other["fingerprints"][3]
    last = max(row["digests"], key=int)
    row["digests"][last] = "0" * 16
    comparison = compare(body, other)
    assert not comparison["decisions_identical"]
    assert [c["identical"] for c in comparison["fingerprints"]].count(False) == 1
    assert summarize({**body, "comparison": comparison})["decisions_identical"] is False


def test_the_growth_exponent_is_the_log_log_slope():
    rows = [{"policy": "p", "units": 16, "restores": n, "compute_ms": {"median": 0.01 * n**2}} for n in (1, 8, 64, 512)]
    assert growth_exponent(rows, "p", 16) == pytest.approx(2.0)
    assert growth_exponent(rows[:3], "p", 16) == pytest.approx(2.0)
    assert growth_exponent(rows[:2], "p", 16) is None  # one size from 8 up: nothing to fit


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_benchmark_workload_is_decided_as_the_oracle_decides_it(policy):
    """The fingerprint cells' workload (identical requests: ties everywhere), every registered policy."""
    for restores, units in ((8, 16), (32, 16)):
        ours = drive(policy, restores, units, picks=60)
        oracle = drive(policy, restores, units, picks=60, scheduler=lambda p: OracleScheduler(p, n_stages=1))
        assert ours.digests == oracle.digests and ours.finished == oracle.finished
