"""`cacheflow demo` end to end on the tiny model and a short slice of the shipped trace (real processes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cacheflow_common.sim.replay import load_slice
from cacheflow_services.cli import main
from cacheflow_services.demo import report as demo_report
from cacheflow_services.demo import run as demo_run
from cacheflow_services.demo.report import POLICY_KEY, LinkChoice, cdf_figure
from cacheflow_services.demo.run import POLICIES, PROBES, SLICE, DemoError, replay_policies, round_orders, step
from cacheflow_services.local_cluster import hold_workdir
from cacheflow_services.replay import ReplayError


def test_the_shipped_slice_keeps_what_the_trace_cached():
    records = load_slice(SLICE)
    assert len(records) == 100 and records[0].request.request_id == "3000"
    assert any(r.request.cached_tokens > 0 for r in records)  # the cache lines 0-2999 left
    assert all(r.request.cached_tokens <= r.request.input_length for r in records)


def test_the_demo_takes_a_window_of_another_trace_where_asked():
    trace = Path(__file__).resolve().parents[2] / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz"
    args = argparse.Namespace(trace=str(trace), start=5000, requests=4, token_scale=8, max_tokens=1536,
                              time_scale=0.01, chunk_size=128)
    chosen = demo_run.choose_requests(args)
    assert len(chosen) == 4 and all(int(r.trace.request_id) >= 5000 for r in chosen)
    assert chosen[0].trace.arrival_s == 0.0 and all(r.trace.cached_tokens >= 256 for r in chosen)
    shipped = demo_run.choose_requests(argparse.Namespace(**{**vars(args), "trace": ""}))
    assert int(shipped[0].trace.request_id) < 3100  # the shipped slice: lines 3000-3099


def test_demo_replays_every_policy_and_writes_its_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CACHEFLOW_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "report"
    assert main(["demo", "--model", "tiny", "--requests", "3", "--max-tokens", "512", "--chunk-size", "64",
                 "--out", str(out)]) == 0
    body = json.loads((out / "demo.json").read_text())
    assert [r["policy"] for r in body["runs"]] == list(POLICIES)
    for run in body["runs"]:
        assert len(run["requests"]) == 3 * 2  # 2 rounds by default
        assert sorted({r["round"] for r in run["requests"]}) == [0, 1]
        assert all(r["ttft_s"] > 0 for r in run["requests"])
        assert run["max_s"] == max(r["ttft_s"] for r in run["requests"]) and "p99_s" not in run
        restored = [r["restored"] for r in run["requests"]]
        if run["policy"] == "compute-only":  # vLLM on a miss: the whole prompt prefilled, nothing restored
            assert restored == [0] * len(restored)
        else:  # every request restored at least two chunks from storage
            assert all(n >= 128 for n in restored)
    report = (out / "demo.md").read_text()
    assert all(f"| {p} |" in report for p in POLICIES)
    assert "max (s)" in report and "P99 (s)" not in report
    assert all(POLICY_KEY[p] in report for p in POLICIES)  # the key: what each policy stands for
    assert (out / "demo.png").stat().st_size > 0
    for run in body["runs"]:  # the spread across rounds: each round's mean
        means = run["round_means_s"]
        assert len(means) == 2 and min(means) <= run["mean_s"] <= max(means)
    by_policy = {r["policy"]: r for r in body["runs"]}
    summary = body["summary"]
    assert summary["cacheflow_vs_cake_mean"] == by_policy["cacheflow"]["mean_s"] / by_policy["cake"]["mean_s"]
    assert summary["cacheflow_vs_cake_slowest"] == by_policy["cacheflow"]["max_s"] / by_policy["cake"]["max_s"]
    winner = min(body["runs"], key=lambda r: r["mean_s"])["policy"]
    assert summary["verdict"].startswith(f"{winner} won on mean TTFT") and summary["verdict"] in report
    assert "speed-up over compute-only (mean)" in report and "round means (s)" in report
    link = body["link"]  # the rate, and how it was chosen: the profile's, checked (and maybe rescaled) here
    assert body["link_gbps_per_pod"] == link["gbps"] == body["cluster"]["rate_gbps"] > 0
    assert link["profile_gbps"] > 0 and link["measured_io_over_compute"] > 0
    assert f"links of {link['gbps'] * 1000:.1f} Mbit/s per storage pod, the profile's balanced rate" in report
    assert f"--link-gbps {link['gbps']:.6g}" in report
    assert list((tmp_path / "cache").glob("profile-quick-tiny-*.json"))  # profiled once, kept for the next run
    printed = capsys.readouterr()
    assert "profiling tiny on this machine" in printed.out and "worker (stage 1) ready on port" in printed.out
    assert f"`--link-gbps {link['gbps']:.6g}` runs at this rate again" in printed.out  # for a rerun
    assert summary["verdict"] in printed.out
    assert " INFO " not in printed.err  # no library's INFO lines (matplotlib's) among the demo's output


def test_a_wrong_model_fails_in_one_line_before_anything_starts(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CACHEFLOW_CACHE", str(tmp_path / "cache"))
    assert main(["demo", "--model", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]) == 2
    printed = capsys.readouterr()
    assert printed.err.count("\n") == 1 and "is neither 'tiny'" in printed.err and "Traceback" not in printed.err
    assert printed.out == ""  # refused before anything is announced: no "profiling ... about a minute"
    assert not (tmp_path / "cache").exists()


def test_a_second_demo_on_the_same_cache_fails_in_one_line_and_empties_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CACHEFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_run, "ensure_profile", lambda args, cache_dir: tmp_path / "profile.json")  # no profiling
    monkeypatch.setattr(demo_run, "balanced_link", lambda args, profile, requests: 1.0)
    monkeypatch.setattr(demo_run.Profile, "load", staticmethod(lambda path, **kw: None))
    running = tmp_path / "cache" / "demo-cluster"
    with hold_workdir(running):  # the first demo, running
        (running / "pod-0").mkdir()
        assert main(["demo", "--model", "tiny", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is in use by another `cacheflow up` or `cacheflow demo`" in err
    assert (running / "pod-0").is_dir()  # the running demo's storage was left alone


def test_bad_demo_settings_fail_in_one_line(capsys):
    assert main(["demo", "--policies", "cake,fastest"]) == 2
    assert "unknown policies ['fastest']" in capsys.readouterr().err
    assert main(["demo", "--rounds", "0"]) == 2
    assert main(["demo", "--link-gbps", "0"]) == 2
    assert "--link-gbps must be a rate above 0 Gbit/s, not 0.0" in capsys.readouterr().err


def _run(policy: str, ttfts_by_round: list[list[float]]) -> dict[str, Any]:
    """A policy's results as replay_policies gives them (its statistics from replay_policies' own helpers)."""
    requests = [{"ttft_s": t, "round": n} for n, ttfts in enumerate(ttfts_by_round) for t in ttfts]
    return {"policy": policy, **demo_run.ttft_summary([r["ttft_s"] for r in requests]),
            "round_means_s": demo_run.round_means(requests, len(ttfts_by_round)), "requests": requests}


def test_the_report_names_the_winner_and_sets_cacheflow_against_cake():
    runs = [_run("compute-only", [[8.0, 12.0], [10.0, 10.0]]), _run("cake", [[5.0, 7.0], [5.0, 7.0]]),
            _run("cacheflow", [[4.0, 6.0], [4.5, 5.5]])]
    ratios = demo_report.ratios_to_cake(runs)
    assert ratios == {"cacheflow_vs_cake_mean": 5.0 / 6.0, "cacheflow_vs_cake_slowest": 6.0 / 7.0}
    said = demo_report.verdict(runs)
    assert said.startswith("cacheflow won on mean TTFT: 5.00 s, 1.00 s ahead of cake (the round means of either "
                           "spread by up to 0.00 s: a clear margin). Fastest slowest request: cacheflow, 6.00 s.")
    assert said.endswith("CacheFlow / Cake: 0.833x on the mean, 0.857x on the slowest request (below 1: CacheFlow "
                         "faster).")
    rows = {row[0]: dict(zip(demo_report.COLUMNS, row, strict=True)) for row in demo_report.table_rows(runs)}
    assert rows["cacheflow"]["round means (s)"] == "5.00-5.00" and rows["cake"]["round means (s)"] == "6.00-6.00"
    assert rows["cacheflow"]["speed-up over compute-only (mean)"] == "2.00x"


def test_a_win_within_the_rounds_spread_is_not_called_clear_and_a_missing_policy_gives_no_ratio():
    runs = [_run("cake", [[5.0], [6.0]]), _run("load-only", [[5.6], [5.6]])]
    said = demo_report.verdict(runs)
    assert "cake won on mean TTFT: 5.50 s, 0.10 s ahead of load-only" in said and "1.00 s: not a clear win" in said
    assert "CacheFlow / Cake" not in said
    assert demo_report.ratios_to_cake(runs) == {"cacheflow_vs_cake_mean": None, "cacheflow_vs_cake_slowest": None}


def test_the_balance_is_measured_after_one_untimed_pair_as_the_median_of_the_timed_ones(monkeypatch):
    times = {"load-only": iter([9.0, 2.0, 3.0, 100.0]), "compute-only": iter([9.0, 1.0, 1.5, 1.0])}
    asked: list[tuple[str, float]] = []

    def restore_alone(url: str, token: str, request: Any, policy: str) -> float:
        asked.append((policy, request.trace.arrival_s))
        return next(times[policy])

    monkeypatch.setattr(demo_run, "restore_alone", restore_alone)
    requests = demo_run.choose_requests(argparse.Namespace(trace="", start=0, requests=3, token_scale=8,
                                                           max_tokens=1536, time_scale=1.0, chunk_size=128))
    cluster = SimpleNamespace(coordinator=SimpleNamespace(url="http://nowhere"), token="t")
    assert demo_run.measured_io_over_compute(cluster, requests) == 3.0 / 1.0  # type: ignore[arg-type]
    assert asked == [("load-only", 0.0), ("compute-only", 0.0)] * (PROBES + 1)  # alternating, each alone


def test_a_given_link_rate_is_used_as_is_and_nothing_is_measured(tmp_path, monkeypatch):
    cluster = SimpleNamespace()
    monkeypatch.setattr(demo_run, "stored_cluster", lambda spec, workdir, requests: cluster)
    monkeypatch.setattr(demo_run, "measured_io_over_compute", lambda *a: pytest.fail("measured a given rate"))
    spec = demo_run.ClusterSpec(model="tiny", rate_gbps=0.25)
    got = demo_run.demo_cluster(argparse.Namespace(link_gbps=0.25), spec, tmp_path, [])
    assert got == (cluster, spec, LinkChoice(0.25, "given with --link-gbps"))
    assert got[2].said() == "links of 250.0 Mbit/s per storage pod, given with --link-gbps"


def test_a_failed_step_is_one_line_naming_it_and_the_logs(tmp_path):
    with pytest.raises(DemoError) as caught, step("replaying the trace", tmp_path):
        raise ReplayError("cake: requests ['1'] failed: 1: HTTP 502: stage 1:\n unreachable")
    message = str(caught.value)
    assert "\n" not in message and message.startswith("replaying the trace failed: cake: requests ['1']")
    assert f"(the cluster's logs: {tmp_path})" in message


def test_policy_order_rotates_each_round():
    assert round_orders(["a", "b", "c"], 4) == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]


def test_replays_are_interleaved_after_one_warm_up_that_is_not_reported():
    calls: list[str] = []

    def fake(url: str, token: str, model: str, requests: list[Any], policy: str, on_done: Any = None
             ) -> list[dict[str, Any]]:
        calls.append(policy)
        return [{"ttft_s": float(len(calls)) + i} for i in range(2)]

    cluster = SimpleNamespace(coordinator=SimpleNamespace(url="http://nowhere"), token="t")
    runs = replay_policies(cluster, "tiny", [], ["x", "y"], 2, send=fake)  # type: ignore[arg-type]
    assert calls == ["y", "x", "y", "y", "x"]  # warm-up (the last policy), then round 1, then round 2 rotated
    by_policy = {r["policy"]: r for r in runs}
    assert [r["ttft_s"] for r in by_policy["x"]["requests"]] == [2.0, 3.0, 5.0, 6.0]  # the warm-up's are not in
    assert [r["round"] for r in by_policy["y"]["requests"]] == [0, 0, 1, 1]
    assert by_policy["x"]["max_s"] == 6.0 and by_policy["x"]["mean_s"] == 4.0


def test_the_cdf_plot_starts_at_zero_and_keeps_every_policy_apart():
    same = [{"ttft_s": t} for t in (5.0, 6.0, 7.0)]
    fig = cdf_figure([{"policy": p, "requests": same} for p in POLICIES])  # identical lines
    ax = fig.axes[0]
    assert ax.get_xlim()[0] == 0
    styles = {(line.get_linestyle(), line.get_marker()) for line in ax.get_lines()}
    assert len(styles) == len(POLICIES)
