"""The restore benchmark end to end (quick mode), checked by invariants a broken benchmark or restore would
break: every run's KV equals the full prefill, each baseline restores only its own way, CacheFlow and Cake
compute a prefix of the units, and the bound is the arithmetic it claims. No timing thresholds."""

from __future__ import annotations

import json
import statistics

import pytest

from cacheflow_bench import restore_runs, restore_single

PREFIX_POLICIES = ("cake", "cacheflow-token", "cacheflow-layer", "cacheflow")


@pytest.fixture(scope="module")
def body(tmp_path_factory):
    out = tmp_path_factory.mktemp("restore")
    assert restore_single.main(["--quick", "--lengths", "256,512", "--ratios", "0.5,2", "--chunk-size", "128",
                                "--dtype", "float32", "--repeats", "2", "--out", str(out)]) == 0
    return json.loads((out / "restore_single.json").read_text()) | {"out": out}


def test_every_policys_kv_equals_the_full_prefill(body):
    for cell in body["cells"]:
        assert set(cell["times_s"]) == set(restore_single.POLICIES)
        for policy, error in cell["kv_max_rel_error"].items():
            assert error["loaded"] == 0.0, (policy, cell["n_tokens"])  # loaded bytes are the saved ones
            assert error["computed"] <= 1e-4, (policy, cell["n_tokens"])  # float32 rounding only


def test_each_baseline_restores_only_its_own_way(body):
    for cell in body["cells"]:
        units = cell["units"]
        assert units["load-only"]["computed"] == [] and units["load-only"]["loaded"] > 0
        assert units["load-only"]["bytes_loaded"] >= max(units[p]["bytes_loaded"] for p in PREFIX_POLICIES) > 0
        assert units["compute-only"]["loaded"] == 0 and units["compute-only"]["bytes_loaded"] == 0
        assert cell["baselines"]["load_only_reads_in_flight"] >= 2
        assert str(cell["baselines"]["compute_only_chunk"]) in cell["baselines"]["compute_only_chunk_times_s"]


def test_two_pointer_policies_compute_a_prefix_of_the_units(body):
    for cell in body["cells"]:
        for policy in PREFIX_POLICIES:
            computed = cell["units"][policy]["computed"]
            assert computed == list(range(len(computed))), (policy, cell["ratio"], computed)


def test_bound_spread_and_cake_are_reported(body):
    s = body["summary"]
    assert body["quick"] is True  # `cacheflow bench report` refuses it
    for key in ("cacheflow_vs_cake_at_balance", "bound_spread", "max_cake_ratio_to_bound", "within_bound_resolvable"):
        assert key in s
    for cell in body["cells"]:
        assert cell["bound_s"] == statistics.median(cell["bound_runs_s"])
        for bound, compute, load in zip(cell["bound_runs_s"], cell["runs_s"]["compute-only"],
                                        cell["runs_s"]["load-only"], strict=True):
            assert bound <= min(compute, load) * 1.0001  # both pure modes are among the bound's candidates
        assert cell["link"]["emulated"] is True
    md = (body["out"] / "restore_single.md").read_text()
    assert "emulated" in md and "| CacheFlow | Cake |" in md and "Cake / T*" in md
    assert md.count("| tiny |") == 4
    assert (body["out"] / "restore_single.png").stat().st_size > 0


def test_the_bound_is_the_best_split_of_the_unit_costs():
    # compute 1, 2, 3 s for units 0..2; load 4, 1, 1 s. Splits k = 0..3: max(0, 6), max(1, 2), max(3, 1), max(6, 0)
    assert restore_runs.split_bound([1.0, 2.0, 3.0], [4.0, 1.0, 1.0]) == 2.0
    assert restore_runs.split_bound([5.0, 5.0], [1.0, 1.0]) == 2.0  # load-only is the best split
    assert restore_runs.split_bound([0.5, 0.5], [9.0, 9.0]) == 1.0  # compute-only is
