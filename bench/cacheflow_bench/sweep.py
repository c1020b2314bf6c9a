"""Trace sweep: disjoint windows of the shipped Mooncake trace at three load levels, every policy on the same
requests, against the batch bound (`cacheflow_common.sched.bound`).

    cacheflow bench sweep --sim-only [--windows 6] [--profile PROFILE.json]

Simulated (`--sim-only`, the mode there is so far): the batch benchmark's cluster and settings (tiny
model, 2 stages, 2 pods, links balanced by a 1,024-token restore, chunk 64, batch 8, the engines'
token budgets, the coordinator's batch window), the simulator uncalibrated (the profile's costs, compute
and I/O on separate hardware). Each window is the next `--requests` requests of the trace that qualify
as in the batch benchmark (lengths / 8, at most 2,048 tokens, at least half cached), starting at line
`--start`; windows never share a line. Load levels stretch or compress the trace's own arrival times:
light x0.2, medium x0.05 (the batch benchmark's), overload x0.01 (its cluster-scale replay). The bound
is solved per window and level, its grid ending at the best policy's last first token.

Writes bench/results/sweep_sim.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheflow_bench.batch_sim import N_PODS, N_STAGES, model_shape, sim_config
from cacheflow_bench.common import TRACE, add_out_option, provenance, results_dir, write_json
from cacheflow_common.restore.profile import Profile
from cacheflow_common.sim import SimConfig, percentile, simulate
from cacheflow_common.sim.bound_input import trace_bound
from cacheflow_common.sim.config import balanced_link_gbps
from cacheflow_common.sim.replay import ReplayRequest, read_records, select_requests
from cacheflow_common.sim.trace import TraceRequest

LEVELS = {"light": 0.2, "medium": 0.05, "overload": 0.01}  # arrival time scales
POLICIES = ("cake", "cacheflow-srpt", "cacheflow-saving", "cacheflow-hrrn", "cacheflow-progress")
BATCH, CHUNK, TOKEN_SCALE, MAX_TOKENS = 8, 64, 8, 2048


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sim-only", action="store_true", required=True,
                   help="simulate only (the real-cluster sweep is not written yet)")
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--start", type=int, default=3000, help="first trace line of the first window")
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--requests", type=int, default=20, help="requests per window")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--profile", default="", help="a `cacheflow profile` of the tiny model (default: profile now)")
    p.add_argument("--slots", type=int, default=40, help="time slots of the bound's grid (mean)")
    add_out_option(p)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 windows of 6 requests")
    args = p.parse_args(argv)
    if args.quick:
        args.windows, args.requests = 2, 6
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


def scaled(window: list[ReplayRequest], scale: float) -> list[TraceRequest]:
    from dataclasses import replace

    return [replace(r.trace, arrival_s=r.trace.arrival_s * scale) for r in window]


def stats(ttft: list[float]) -> dict[str, float]:
    s = sorted(ttft)
    return {"mean_s": sum(s) / len(s), "p50_s": percentile(s, 50), "p99_s": percentile(s, 99), "max_s": s[-1]}


def cell(trace: list[TraceRequest], configs: dict[str, SimConfig], slots: int) -> dict[str, Any]:
    """Every policy on one window at one load level, and the bound."""
    out: dict[str, Any] = {}
    horizon = float("inf")
    for policy, config in configs.items():
        result = simulate(trace, config)
        out[policy] = stats([r.ttft_s for r in result.requests]) | {
            "computed_fraction": result.summary()["computed_fraction"]}
        horizon = min(horizon, max(r.arrival_s + r.ttft_s for r in result.requests))
    began = time.perf_counter()
    bound = trace_bound(trace, next(iter(configs.values())), horizon_s=horizon, slots=slots)
    out["bound"] = {"mean_s": bound.mean_ttft_s, "max_s": bound.max_ttft_s, "solve_s": time.perf_counter() - began}
    return out


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


def report(body: dict[str, Any]) -> str:
    policies = body["policies"]
    about = " ".join((__doc__ or "").split(chr(10) * 2)[2].split())
    lines = [f"# Trace sweep (simulated)\n\nCommand: `{body['command']}`. {about}"
             f"\n\nWindows: {body['windows']} of {body['requests']} requests (trace lines "
             f"{body['lines'][0]}..{body['lines'][1]}). Ratios per window; worst (max) and median over windows.\n"]
    for level, per in body["summary"].items():
        lines.append(f"\n## {level} (arrivals x{LEVELS[level]})\n")
        lines.append("| policy | mean/Cake worst | mean/Cake median | slowest/Cake worst | slowest/Cake median | "
                     "mean/bound median | slowest/bound median |")
        lines.append("|---|---|---|---|---|---|---|")
        for p in policies:
            s = per[p]
            lines.append(f"| {p} | {s['mean_vs_cake_max']:.3f} | {s['mean_vs_cake_median']:.3f} | "
                         f"{s['max_vs_cake_max']:.3f} | {s['max_vs_cake_median']:.3f} | "
                         f"{s['mean_vs_bound_median']:.3f} | {s['max_vs_bound_median']:.3f} |")
    lines.append("\n## Per window\n")
    lines.append("| level | window | " + " | ".join(f"{p} mean / P50 / P99 / max (s)" for p in policies)
                 + " | bound mean / max (s) |")
    lines.append("|---|---|" + "---|" * (len(policies) + 1))
    for r in body["rows"]:
        cells = [f"{r[p]['mean_s']:.3f} / {r[p]['p50_s']:.3f} / {r[p]['p99_s']:.3f} / {r[p]['max_s']:.3f}"
                 for p in policies]
        lines.append(f"| {r['level']} | {r['window']} | " + " | ".join(cells)
                     + f" | {r['bound']['mean_s']:.3f} / {r['bound']['max_s']:.3f} |")
    return "\n".join(lines) + "\n"


def write_plot(path: Path, body: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    levels = list(LEVELS)
    for ax, key, title in ((axes[0], "mean_s", "mean TTFT"), (axes[1], "max_s", "slowest request's TTFT")):
        for name in [*body["policies"], "bound"]:
            ys = [statistics.median(r[name][key] / r["cake"][key] for r in body["rows"] if r["level"] == lv)
                  for lv in levels]
            ax.plot(levels, ys, marker="o", label=name, linestyle="--" if name == "bound" else "-")
        ax.set_title(f"{title} / Cake's (median over windows)")
        ax.axhline(1.0, color="grey", linewidth=0.5)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    policies = args.policies.split(",")
    if "cake" not in policies:
        raise SystemExit("the sweep compares with cake: keep it in --policies")
    shape = model_shape()
    with tempfile.TemporaryDirectory() as tmp:
        if args.profile:
            profile = Profile.load(Path(args.profile))
        else:
            from cacheflow_bench.batch import profile_machine

            profile = profile_machine(Path(tmp), CHUNK, MAX_TOKENS)
    link = balanced_link_gbps(profile.costs, shape, n_stages=N_STAGES, n_channels=N_PODS, tokens=1024)
    configs = {p: sim_config(profile, shape, policy=p, batch=BATCH, n_stages=N_STAGES, n_channels=N_PODS,
                             link_gbps=link, chunk_size=CHUNK) for p in policies}
    wins = windows(Path(args.trace), args.start, args.windows, args.requests)
    rows = []
    for w, window in enumerate(wins):
        for level, scale in LEVELS.items():
            rows.append({"level": level, "window": w, **cell(scaled(window, scale), configs, args.slots)})
            r = rows[-1]
            print(f"window {w} {level:>8}: " + ", ".join(f"{p} {r[p]['mean_s']:.3f}/{r[p]['max_s']:.3f}"
                                                        for p in policies)
                  + f", bound {r['bound']['mean_s']:.3f}/{r['bound']['max_s']:.3f} s", flush=True)
    lines = (int(wins[0][0].trace.request_id), int(wins[-1][-1].trace.request_id)) if wins else (0, 0)
    body = {**provenance(args.quick), "policies": policies, "windows": len(wins), "requests": args.requests,
            "lines": lines, "link_gbps_per_pod": link, "levels": LEVELS, "summary": summarize(rows, policies),
            "rows": rows}
    out = results_dir(args)
    write_json(out / "sweep_sim.json", body)
    (out / "sweep_sim.md").write_text(report(body))
    write_plot(out / "sweep_sim.png", body)
    print(report(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
