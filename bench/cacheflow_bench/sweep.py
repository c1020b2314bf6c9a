"""Trace sweep: disjoint windows of the shipped Mooncake trace at three load levels, every policy on the same
requests, against Cake and the batch bound (`cacheflow_common.sched.bound`).

    cacheflow bench sweep [--windows 6] [--rounds 2]                  # the local cluster (~40 min, 2 cores)
    cacheflow bench sweep --sim-only [--profile PROFILE.json]        # the simulator only (seconds)

Each window is the next `--requests` requests of the trace that qualify as in the batch benchmark
(lengths / 8, at most 2,048 tokens, at least half cached), starting at line `--start`; windows never
share a line. Load levels stretch or compress the trace's own arrival times: light x0.2 (requests
rarely overlap), medium x0.05 (the batch benchmark's), overload x0.01 (the queue grows). The bound is
solved per window and level, its grid ending at the best policy's last first token.

On the cluster (`sweep_cluster.py`) the batch benchmark's cluster replays every cell, policies
interleaved; the bound and the simulator's predictions use the cost model calibrated in the same run.
Writes bench/results/sweep.{json,md,png} and the sweep's summary keys into batch.json. With
`--sim-only`, the batch benchmark's cluster simulated with the profile's costs, uncalibrated (compute
and I/O on separate hardware): bench/results/sweep_sim.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from cacheflow_bench.batch_sim import N_PODS, N_STAGES, model_shape, sim_config
from cacheflow_bench.common import TRACE, add_out_option, provenance, results_dir, write_json
from cacheflow_bench.sweep_report import report, summary_keys, write_plot
from cacheflow_common.restore.profile import Profile
from cacheflow_common.sim import SimConfig, percentile, simulate
from cacheflow_common.sim.bound_input import trace_bound
from cacheflow_common.sim.config import balanced_link_gbps
from cacheflow_common.sim.replay import ReplayRequest, read_records, select_requests
from cacheflow_common.sim.trace import TraceRequest

LEVELS = {"light": 0.2, "medium": 0.05, "overload": 0.01}  # arrival time scales
POLICIES = ("cake", "cacheflow", "cacheflow-srpt", "cacheflow-saving", "cacheflow-hrrn", "cacheflow-progress")
CLUSTER_POLICIES = ("cake", "cacheflow", "cacheflow-srpt")  # on the cluster: CacheFlow, the rule it replaced
BATCH, CHUNK, TOKEN_SCALE, MAX_TOKENS = 8, 64, 8, 2048


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim-only", action="store_true", help="simulate only (seconds; no cluster)")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--start", type=int, default=3000, help="first trace line of the first window")
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--requests", type=int, default=20, help="requests per window")
    p.add_argument("--policies", default="", help="comma-separated (default: every ranking simulated; "
                   f"on the cluster {', '.join(CLUSTER_POLICIES)})")
    p.add_argument("--rounds", type=int, default=2, help="on the cluster: replays per policy and cell, interleaved")
    p.add_argument("--profile", default="", help="--sim-only: a `cacheflow profile` of the tiny model "
                   "(default: profile now)")
    p.add_argument("--slots", type=int, default=40, help="time slots of the bound's grid (mean)")
    add_out_option(p)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 windows of 6 requests (1 round)")
    args = p.parse_args(argv)
    if args.quick:
        args.windows, args.requests, args.rounds = 2, 6, 1
    args.policy_names = (args.policies.split(",") if args.policies
                         else list(POLICIES if args.sim_only else CLUSTER_POLICIES))
    if "cake" not in args.policy_names:
        p.error("the sweep compares with cake: keep it in --policies")
    args.batch, args.chunk_size, args.max_tokens = BATCH, CHUNK, MAX_TOKENS
    return args


def windows(path: Path, start: int, count: int, size: int) -> list[list[ReplayRequest]]:
    """`count` disjoint windows of `size` qualifying requests each, unscaled in time (x1)."""
    out, line = [], start
    for _ in range(count):
        records = read_records(path, start=line, scan=2000)
        chosen = select_requests(records, count=size, token_scale=TOKEN_SCALE, max_tokens=MAX_TOKENS, time_scale=1.0)
        if len(chosen) < size:
            break
        out.append(chosen)
        line = int(chosen[-1].trace.request_id) + 1
    return out


def at_level(window: list[ReplayRequest], scale: float) -> list[ReplayRequest]:
    """The window with its arrival times multiplied by `scale`."""
    return [replace(r, trace=replace(r.trace, arrival_s=r.trace.arrival_s * scale)) for r in window]


def scaled(window: list[ReplayRequest], scale: float) -> list[TraceRequest]:
    """The window's trace requests at a load level (arrival times multiplied by `scale`)."""
    return [r.trace for r in at_level(window, scale)]


def stats(ttft: list[float]) -> dict[str, float]:
    s = sorted(ttft)
    return {"mean_s": sum(s) / len(s), "p50_s": percentile(s, 50), "p99_s": percentile(s, 99), "max_s": s[-1]}


def with_bound(out: dict[str, Any], trace: list[TraceRequest], config: SimConfig, policies: list[str],
               slots: int) -> dict[str, Any]:
    """`out` (per policy: TTFT statistics) with the batch bound of `trace` on the cluster `config` models, its
    grid ending at the best policy's last first token."""
    horizon = min(max(r.arrival_s + t for r, t in zip(trace, out[p]["ttft_s"], strict=True)) for p in policies)
    began = time.perf_counter()
    bound = trace_bound(trace, config, horizon_s=horizon, slots=slots)
    return out | {"bound": {"mean_s": bound.mean_ttft_s, "max_s": bound.max_ttft_s,
                            "solve_s": time.perf_counter() - began}}


def sim_cell(trace: list[TraceRequest], configs: dict[str, SimConfig], slots: int) -> dict[str, Any]:
    """Every policy simulated on one window at one load level, and the bound."""
    out: dict[str, Any] = {}
    for policy, config in configs.items():
        result = simulate(trace, config)
        ttft = [r.ttft_s for r in result.requests]
        out[policy] = stats(ttft) | {"ttft_s": ttft, "computed_fraction": result.summary()["computed_fraction"]}
    return with_bound(out, trace, next(iter(configs.values())), list(configs), slots)


def sim_rows(args: argparse.Namespace, wins: list[list[ReplayRequest]]) -> tuple[list[dict[str, Any]], float]:
    shape = model_shape()
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            profile = Profile.load(Path(args.profile))
        else:
            from cacheflow_bench.batch import profile_machine

            profile = profile_machine(Path(tmp), CHUNK, MAX_TOKENS)
    link = balanced_link_gbps(profile.costs, shape, n_stages=N_STAGES, n_channels=N_PODS, tokens=1024)
    configs = {p: sim_config(profile, shape, policy=p, batch=BATCH, n_stages=N_STAGES, n_channels=N_PODS,
                             link_gbps=link, chunk_size=CHUNK) for p in args.policy_names}
    rows = []
    for w, window in enumerate(wins):
        for level, scale in LEVELS.items():
            rows.append({"level": level, "window": w, **sim_cell(scaled(window, scale), configs, args.slots)})
            _print_row(rows[-1], args.policy_names)
    return rows, link


def cluster_rows(args: argparse.Namespace, wins: list[list[ReplayRequest]]
                 ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from cacheflow_bench.sweep_cluster import cluster_cells  # the cluster's services, only when they run

    cells, run = cluster_cells(args, wins, LEVELS, args.policy_names)
    config = sim_config(run["profile"], run["shape"], policy="cacheflow", batch=BATCH, n_stages=N_STAGES,
                        n_channels=N_PODS, link_gbps=run["link_gbps_per_pod"], chunk_size=CHUNK,
                        calibration=run["calibration"])  # the bound's cost model (its policy plays no part)
    rows = []
    for cell in cells:
        trace = scaled(wins[cell["window"]], LEVELS[cell["level"]])
        out = {p: stats(cell[p]["ttft_s"]) | cell[p] | _sim_error(cell[p]) for p in args.policy_names}
        rows.append({"level": cell["level"], "window": cell["window"], "failed_first_try": cell["failed_first_try"],
                     **with_bound(out, trace, config, args.policy_names, args.slots)})
        _print_row(rows[-1], args.policy_names)
    return rows, {"link_gbps_per_pod": run["link_gbps_per_pod"], "calibration": vars(run["calibration"])}


def _sim_error(policy_cell: dict[str, Any]) -> dict[str, float]:
    """The calibrated simulator's mean TTFT and its relative error against the measured mean."""
    real, sim = statistics.fmean(policy_cell["ttft_s"]), statistics.fmean(policy_cell["sim_ttft_s"])
    return {"sim_mean_s": sim, "sim_mean_rel_error": abs(sim - real) / real}


def _print_row(row: dict[str, Any], policies: list[str]) -> None:
    print(f"window {row['window']} {row['level']:>8}: "
          + ", ".join(f"{p} {row[p]['mean_s']:.3f}/{row[p]['max_s']:.3f}" for p in policies)
          + f", bound {row['bound']['mean_s']:.3f}/{row['bound']['max_s']:.3f} s", flush=True)


def summarize(rows: list[dict[str, Any]], policies: list[str]) -> dict[str, Any]:
    """Per level and policy: worst and median ratios of the mean and the slowest request vs Cake and vs the bound."""
    out: dict[str, Any] = {}
    for level in LEVELS:
        mine = [r for r in rows if r["level"] == level]
        per: dict[str, Any] = {}
        for p in policies:
            ratios = {
                "mean_vs_cake": [r[p]["mean_s"] / r["cake"]["mean_s"] for r in mine],
                "max_vs_cake": [r[p]["max_s"] / r["cake"]["max_s"] for r in mine],
                "mean_vs_bound": [r[p]["mean_s"] / r["bound"]["mean_s"] for r in mine],
                "max_vs_bound": [r[p]["max_s"] / r["bound"]["max_s"] for r in mine],
            }
            per[p] = {f"{k}_{agg.__name__}": agg(v) for k, v in ratios.items() for agg in (max, statistics.median)}
        out[level] = per
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    wins = windows(Path(args.trace), args.start, args.windows, args.requests)
    if args.sim_only:
        rows, link = sim_rows(args, wins)
        run: dict[str, Any] = {"link_gbps_per_pod": link}
    else:
        rows, run = cluster_rows(args, wins)
    lines = (int(wins[0][0].trace.request_id), int(wins[-1][-1].trace.request_id)) if wins else (0, 0)
    body = {**provenance(args.quick), "simulated": args.sim_only, "policies": args.policy_names,
            "windows": len(wins), "requests": args.requests, "rounds": None if args.sim_only else args.rounds,
            "lines": lines, **run, "levels": LEVELS, "headline": summary_keys(rows, args.policy_names),
            "summary": summarize(rows, args.policy_names), "rows": rows}
    out = results_dir(args)
    name = "sweep_sim" if args.sim_only else "sweep"
    write_json(out / f"{name}.json", body)
    (out / f"{name}.md").write_text(report(body, __doc__ or ""))
    write_plot(out / f"{name}.png", body)
    if not args.sim_only:
        merge_into_batch(out / "batch.json", body["headline"])
    print(report(body, __doc__ or ""))
    return 0


def merge_into_batch(path: Path, headline: dict[str, float]) -> None:
    """The sweep's summary keys beside the batch benchmark's (its targets are read there)."""
    body = json.loads(path.read_text()) if path.exists() else {"summary": {}}
    body["summary"] = {k: v for k, v in body["summary"].items() if not k.startswith("sweep_")} | headline
    write_json(path, body)


if __name__ == "__main__":
    raise SystemExit(main())
