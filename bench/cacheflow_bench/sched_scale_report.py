"""The scale benchmark's summary, its comparison with a baseline run, and its Markdown table and plot."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from cacheflow_bench.common import markdown_table

HEADLINE = ("cacheflow", 512, 64)  # the cell the targets name (policy, restores, units)
TARGETS = {"compute_pick_median_ms_512x64": "<= 0.5", "compute_pick_p99_ms_512x64": "<= 2",
           "channel_pick_median_ms_512x64": "<= 0.1",
           "growth_exponent_compute": "<= 1.2",
           "decisions_identical": "true", "sim_wall_s_10000": "<= 20", "engine_sched_share_max": "< 0.10"}
GROWTH_FROM = 8  # the fit starts here: at 1 restore a pick's fixed costs are all there is


def _key(row: dict[str, Any]) -> tuple[str, int, int]:
    return row["policy"], row["restores"], row["units"]


def growth_exponent(cells: list[dict[str, Any]], policy: str, units: int) -> float | None:
    """k of median compute pick ~ restores^k, least squares in log-log over GROWTH_FROM restores and up."""
    points = [(math.log(r["restores"]), math.log(r["compute_ms"]["median"])) for r in cells
              if r["policy"] == policy and r["units"] == units and r["restores"] >= GROWTH_FROM]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def same_decisions(after: dict[str, str], before: dict[str, str]) -> tuple[int, bool]:
    """(compute picks compared, whether both runs decided alike up to there): at the most picks both record."""
    common = set(after) & set(before)
    if not common:
        return 0, False
    picks = max(common, key=int)
    return int(picks), after[picks] == before[picks]


def compare(body: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """This run against the baseline's: cost side by side, and whether the decisions are the same."""
    before = {_key(r): r for r in baseline["cells"]}
    cells = []
    for row in body["cells"]:
        old = before.get(_key(row))
        if old is None:
            continue
        compared, identical = same_decisions(row["digests"], old["digests"])
        cells.append({"policy": row["policy"], "restores": row["restores"], "units": row["units"],
                      "before_compute_ms": old["compute_ms"], "before_channel_ms": old["channel_ms"],
                      "before_compute_picks": old["compute_picks"],
                      "compute_speedup": old["compute_ms"]["median"] / row["compute_ms"]["median"],
                      "decisions_compared": compared, "identical": identical})
    old_prints = {_key(r): r for r in baseline["fingerprints"]}
    prints = []
    for row in body["fingerprints"]:
        if _key(row) in old_prints:
            compared, identical = same_decisions(row["digests"], old_prints[_key(row)]["digests"])
            prints.append({"policy": row["policy"], "restores": row["restores"], "units": row["units"],
                           "decisions_compared": compared, "identical": identical})
    checked = cells + prints
    return {"cells": cells, "fingerprints": prints,
            "decisions_identical": bool(checked) and all(c["identical"] for c in checked),
            "sim_same_predictions": body["sim"]["digest"] == baseline["sim"]["digest"]
            and body["sim"]["requests"] == baseline["sim"]["requests"]}


def summarize(body: dict[str, Any]) -> dict[str, Any]:
    cells = {_key(r): r for r in body["cells"]}
    summary: dict[str, Any] = {}
    for policy in sorted({r["policy"] for r in body["cells"]}):
        row = cells.get((policy, *HEADLINE[1:]))
        if row is not None:
            suffix = "" if policy == HEADLINE[0] else f"_{policy}"
            summary[f"compute_pick_median_ms_512x64{suffix}"] = row["compute_ms"]["median"]
            summary[f"compute_pick_p99_ms_512x64{suffix}"] = row["compute_ms"]["p99"]
            summary[f"compute_pick_worst_ms_512x64{suffix}"] = row["compute_ms"]["worst"]
            summary[f"channel_pick_median_ms_512x64{suffix}"] = row["channel_ms"]["median"]
            if "compute_cpu_ms" in row:  # CPU time: what the machine's other jobs cannot add to
                summary[f"compute_pick_cpu_median_ms_512x64{suffix}"] = row["compute_cpu_ms"]["median"]
                summary[f"compute_pick_cpu_p99_ms_512x64{suffix}"] = row["compute_cpu_ms"]["p99"]
                summary[f"channel_pick_cpu_median_ms_512x64{suffix}"] = row["channel_cpu_ms"]["median"]
    growth = {f"{p}/{u}": k for p in sorted({r["policy"] for r in body["cells"]})
              for u in sorted({r["units"] for r in body["cells"]})
              if (k := growth_exponent(body["cells"], p, u)) is not None}
    summary["growth_exponent_compute"] = max(growth.values()) if growth else None  # the worst policy and size
    summary["growth_exponents"] = growth
    comparison = body.get("comparison")
    summary["decisions_identical"] = comparison["decisions_identical"] if comparison else None
    summary["sim_requests"] = body["sim"]["requests"]
    summary["sim_wall_s"] = body["sim"]["wall_s"]
    if body["sim"]["requests"] == 10_000:
        summary["sim_wall_s_10000"] = body["sim"]["wall_s"]
    shares = [r["sched_share"] for r in body["engine"]]
    summary["engine_restores"] = body["engine"][0]["restores"]
    summary["engine_sched_share_max"] = max(shares)
    if "baseline" in body:
        summary["before"] = {k: v for k, v in body["baseline"]["summary"].items()
                             if k != "growth_exponents" and not k.startswith("before")}
    return summary


def _ms(cost: dict[str, float]) -> str:
    return f"{cost['median']:.3f} / {cost['p99']:.3f} / {cost['worst']:.3f}"


def _cpu(row: dict[str, Any], pick: str) -> str:
    cost = row.get(f"{pick}_cpu_ms")
    return "-" if cost is None else f"{cost['median']:.3f} / {cost['p99']:.3f}"


def report(body: dict[str, Any]) -> str:
    s = body["summary"]
    before = s.get("before", {})
    lines = [
        "# The batch scheduler at production batch sizes",
        "",
        f"Command: `{body['command']}`{' (--quick smoke run)' if body['quick'] else ''}. Machine: "
        f"{body['machine']['cpu']}, {body['machine']['cpus']} CPUs, Python {body['machine']['python']}, "
        f"git {body['machine']['git']}. Wall times on a shared machine: other jobs ran beside this one, so "
        "single samples (P99, worst) are noisy; each decision's CPU time (its thread's) is beside it, which "
        "other jobs cannot add to.",
        "",
        "## Targets",
        "",
        markdown_table(["summary key", "this run", "target", *(["before"] if before else [])],
                       [[k, _cell(s.get(k)), t, *([_cell(before.get(k))] if before else [])]
                        for k, t in TARGETS.items()]),
        "",
        "## Decision cost (ms: median / P99 / worst wall time; CPU time median / P99)",
        "",
        "One stage's scheduler in a closed loop: the restores stay concurrent (a finished one is replaced), 2 "
        f"channels, steps of at most {body['setup']['step_tokens']} tokens, GPU-like unit costs "
        f"(`sched_scale_drive`); {body['setup']['picks_per_cell']} compute picks per cell at most.",
        "",
        _cost_table(body),
        "",
        "Growth exponent k of the median compute pick ~ restores^k (8 to 1,024 restores): "
        + ", ".join(f"{k} {v:.2f}" for k, v in s["growth_exponents"].items()) + ".",
        "",
        "## The simulator and the engine",
        "",
        f"Simulator, {s['sim_requests']} requests of the Mooncake trace (`cacheflow`, 4 stages, 4 pods, at "
        f"most {body['sim']['max_batch']} requests at once, GPU-like costs): {s['sim_wall_s']:.1f} s, mean TTFT "
        f"{body['sim']['ttft_mean_s']:.6f} s" + (_sim_before(body) if "baseline" in body else "") + ".",
        "",
        _engine_table(body),
        "",
    ]
    if "comparison" in body:
        c = body["comparison"]
        same = sum(x["identical"] for x in c["cells"] + c["fingerprints"])
        lines += [f"Decisions compared with the baseline ({body['baseline']['label'] or 'before'}): {same} of "
                  f"{len(c['cells']) + len(c['fingerprints'])} cells identical (timed cells, and every registered "
                  "policy on the fingerprint cells), each up to the most compute picks both runs made.", ""]
    return "\n".join(lines)


def _sim_before(body: dict[str, Any]) -> str:
    before = body["baseline"]["sim"]
    text = f" (before: {before['wall_s']:.1f} s, mean TTFT {before['ttft_mean_s']:.6f} s"
    if body["comparison"]["sim_same_predictions"]:
        return text + "; the same prediction for every request)"
    return text + ("; not the same predictions: these costs are not whole ticks, and where two sums of float "
                   "seconds tie exactly the scheduler before summed them in batch order, so its answer there came "
                   "from rounding, where this one's sums are exact)")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return "-" if value is None else str(value)


def _cost_table(body: dict[str, Any]) -> str:
    compared = {_key(c): c for c in body.get("comparison", {}).get("cells", [])}
    header = ["policy", "restores x units", "compute pick", "compute pick, CPU", "channel pick",
              "channel pick, CPU", "picks"]
    if compared:
        header += ["before: compute pick", "before: channel pick", "median speedup", "same decisions (picks)"]
    rows = []
    for r in body["cells"]:
        row = [r["policy"], f"{r['restores']} x {r['units']}", _ms(r["compute_ms"]), _cpu(r, "compute"),
               _ms(r["channel_ms"]), _cpu(r, "channel"), r["compute_picks"]]
        c = compared.get(_key(r))
        if compared:
            row += (["-"] * 4 if c is None else
                    [_ms(c["before_compute_ms"]), _ms(c["before_channel_ms"]), f"{c['compute_speedup']:.1f}x",
                     f"{'yes' if c['identical'] else 'NO'} ({c['decisions_compared']})"])
        rows.append(row)
    return markdown_table(header, rows)


def _engine_table(body: dict[str, Any]) -> str:
    before = {(r["mode"], r["policy"]): r for r in body.get("baseline", {}).get("engine", [])}
    header = ["engine loop", "policy", "restores", "steps", "step median (ms)", "compute pick median / worst (ms)",
              "channel pick median (ms)", "scheduler share of steps"]
    if before:
        header.append("before: share")
    rows = []
    for r in body["engine"]:
        row = [r["mode"], r["policy"], r["restores"], r["steps"], f"{r['step_ms_median']:.1f}",
               f"{r['compute_pick_ms_median']:.3f} / {r['compute_pick_ms_worst']:.3f}",
               f"{r['channel_pick_ms_median']:.3f}", f"{100 * r['sched_share']:.2f} %"]
        if before:
            old = before.get((r["mode"], r["policy"]))
            row.append("-" if old is None else f"{100 * old['sched_share']:.2f} %")
        rows.append(row)
    return markdown_table(header, rows)


def plot(path: Path, body: dict[str, Any]) -> None:
    """Median compute pick against concurrent restores, log-log; the baseline's dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    runs = [("", body["cells"], "-")]
    if "baseline" in body:
        runs.append((" (before)", body["baseline"]["cells"], "--"))
    colors: dict[tuple[str, int], str] = {}
    for suffix, cells, style in runs:
        for policy in sorted({r["policy"] for r in cells}):
            for units in sorted({r["units"] for r in cells}):
                pts = sorted((r["restores"], r["compute_ms"]["median"]) for r in cells
                             if r["policy"] == policy and r["units"] == units)
                color = colors.setdefault((policy, units), f"C{len(colors)}")
                ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, color=color,
                        label=f"{policy}, {units} units{suffix}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("concurrent restores")
    ax.set_ylabel("compute pick, median (ms)")
    ax.set_title("Batch scheduler: one decision's cost")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
