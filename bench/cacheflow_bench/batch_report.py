"""The batch benchmark's summary, tables and plot."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

STATS = ("mean_s", "p50_s", "p90_s", "p99_s")


def by_batch_and_policy(runs: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    """The runs of each batch size and policy (repeats), in the order they ran."""
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["batch"], run["policy"]), []).append(run)
    return groups


def aggregate(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per batch size and policy, over its repeated runs: the median of each TTFT statistic, and the
    range of the mean and P99 (how much one run's numbers move on this machine)."""
    out = []
    for (batch, policy), mine in by_batch_and_policy(runs).items():
        row: dict[str, Any] = {"batch": batch, "policy": policy, "repeats": len(mine)}
        row |= {k: statistics.median(r[k] for r in mine) for k in STATS}
        row |= {k: statistics.median(r[k] for r in mine) for k in ("compute_busy_share", "io_busy_share")
                if all(k in r for r in mine)}
        row |= {f"{k}_{end}": f(r[k] for r in mine) for k in ("mean_s", "p99_s") for end, f in (("min", min),
                                                                                                   ("max", max))}
        out.append(row)
    return out


def _row(rows: list[dict[str, Any]], batch: int, policy: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["batch"] == batch and r["policy"] == policy), None)


def summary_of(runs: list[dict[str, Any]], errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets at the largest batch replayed (8 by default), medians over repeats: measured on the local
    cluster; the simulator's errors over every batch size and policy."""
    rows = aggregate(runs)
    batch = max(r["batch"] for r in rows)
    cf, cake, compute = (_row(rows, batch, p) for p in ("cacheflow", "cake", "compute-only"))
    baselines = [r for r in (compute, _row(rows, batch, "load-only"), cake) if r]
    mine = by_batch_and_policy(runs).get((batch, "cacheflow"), [])
    pooled = sorted(x for e in errors for x in e.get("errors", []))
    return {
        "batch": batch,
        "mean_ratio_vs_best_baseline_b8": cf["mean_s"] / min(r["mean_s"] for r in baselines) if cf and baselines
        else None,
        "best_baseline_b8": min(baselines, key=lambda r: r["mean_s"])["policy"] if baselines else None,
        "p99_ratio_vs_cake_b8": cf["p99_s"] / cake["p99_s"] if cf and cake else None,
        "mean_ratio_vs_cake_b8": cf["mean_s"] / cake["mean_s"] if cf and cake else None,
        "mean_speedup_vs_compute_only_b8": compute["mean_s"] / cf["mean_s"] if cf and compute else None,
        "compute_busy_share_b8": _median_of(mine, "compute_busy_share"),
        "io_busy_share_b8": _median_of(mine, "io_busy_share"),
        "rankings_mean_s_b8": {r["policy"]: r["mean_s"] for r in rows if r["batch"] == batch
                               and r["policy"].startswith("cacheflow")},
        "sim_mean_rel_error": max(e["mean_rel_error"] for e in errors) if errors else None,
        "sim_median_rel_error": pooled[len(pooled) // 2] if pooled else None,
        "sim_max_rel_error": max(e["max_rel_error"] for e in errors) if errors else None,
        "run_max_rel_spread": max(e["run_max_rel_spread"] for e in errors) if errors else None,
        "run_median_rel_spread": statistics.median(e["run_median_rel_spread"] for e in errors) if errors else None,
        "runs_repeated_after_a_failure": sum(bool(r.get("failed_first_try")) for r in runs),
    }


def _median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def target_rows(s: dict[str, Any]) -> list[list[Any]]:
    """The batch bench's targets (target, measured, goal) from its JSON summary: its Markdown and REPORT.md."""
    return [
        [f"CacheFlow mean TTFT / the best baseline's ({s['best_baseline_b8']}), batch {s['batch']}",
         s["mean_ratio_vs_best_baseline_b8"], "<= 0.85"],
        [f"CacheFlow P99 TTFT / Cake's, batch {s['batch']} (mean: {_num(s['mean_ratio_vs_cake_b8'])})",
         s["p99_ratio_vs_cake_b8"], "<= 0.90"],
        [f"compute-only mean TTFT / CacheFlow's, batch {s['batch']}", s["mean_speedup_vs_compute_only_b8"], ">= 2.0"],
        ["simulator: worst error of a run's mean restore time", s["sim_mean_rel_error"], "<= 0.10"],
        ["simulator: median per-request restore-time error", s["sim_median_rel_error"], "<= 0.20"],
        ["simulator: worst per-request restore-time error", s["sim_max_rel_error"], ""],
        [f"CacheFlow compute-loop / channel busy share, batch {s['batch']} (paper: 0.88 / 0.78)",
         f"{_num(s['compute_busy_share_b8'])} / {_num(s['io_busy_share_b8'])}", ""],
        ["one batched forward over 8 requests' 64-token chunks vs 8 single ones (throughput)",
         s.get("batched_forward_speedup"), ">= 1.3"],
        ["one run vs the median of its repeats, per request: worst / median (the machine's own noise)",
         f"{s['run_max_rel_spread']:.3f} / {s['run_median_rel_spread']:.3f}", ""],
        *([[f"mean / slowest-request TTFT over the batch bound, batch {s['batch']}: CacheFlow; Cake",
            f"{_num(s['mean_over_bound_cacheflow_b8'])} / {_num(s['max_over_bound_cacheflow_b8'])}; "
            f"{_num(s.get('mean_over_bound_cake_b8'))} / {_num(s.get('max_over_bound_cake_b8'))}", ""]]
          if "mean_over_bound_cacheflow_b8" in s else []),
    ]


BASELINES = [
    "Baselines, each at its strongest in this engine:",
    "- **compute-only** is what vLLM does on a miss, with the engine's fastest recompute: the whole prompt "
    "prefilled through the stages in one pass, batched with the other requests' prefills like any prefill; "
    "nothing is looked up or loaded.",
    "- **load-only** loads every chunk (LMCache-style), oldest request first; each pod channel keeps one read in "
    "flight (deeper pipelining is not built); the pod books its link before it fetches, so a fetch overlaps "
    "its own transfer, and an idle link credits up to 256 KiB (about 20 ms at these rates) of the gap between "
    "one read and the next.",
    "- **Cake** runs its per-request token-wise two pointers, the channels serving requests in arrival order.",
    "- **CacheFlow** advances, in each compute step, the requests with the least recomputation left and the "
    "oldest, and its channels serve the oldest request (`sched/policies.py`); the rule it replaced "
    "(`cacheflow-srpt`: every request in every step, channels to the least recomputation left) and the other "
    "rankings are rows of their own at the largest batch.",
]


def write_markdown(path: Path, body: dict[str, Any], table: Callable[..., str]) -> None:
    s, facts = body["summary"], body["machine"]
    lines = ["# Batch restore on the local cluster and in the simulator", "",
             f"Machine: {facts['cpu']}, {facts['cpus']} CPUs; git {facts['git']}. Command: `{body['command']}`.",
             f"{len(body['requests'])} trace requests, link {body['link_gbps_per_pod']:.4f} Gbit/s per pod, "
             "emulated (each pod's token bucket, at the rate that makes Tio/Tcomp = 1 per stage for a 1,024-token "
             "prefix by the profile's costs). Simulator calibration (the shortest and a median request served "
             "alone, measured / profiled: compute-only prefills for compute, load-only restores for load and "
             f"the fixed time per restore): compute x{body['calibration']['compute']:.2f}, "
             f"load x{body['calibration']['load']:.2f}, plus {body['calibration']['overhead_s']:.3f} s "
             "per restore outside the two pointers; a compute step that starts while loads are in flight takes "
             f"x{body['calibration'].get('slowdown', 1.0):.2f} (fitted to a median request restored alone by Cake: "
             "the loaders and pods share this host's cores with the compute loops). Simulated requests enter the "
             "admission queue when the real ones did (after their prefix lookup).",
             "", *BASELINES, "",
             table(["target", "measured", "goal"], target_rows(s)), "", *_failures(body["runs"]),
             "## Local cluster: TTFT (s), median of the repeated runs (range over them)", "",
             table(["batch", "policy", "runs", "mean", "P50", "P90", "P99", "compute / channel busy"],
                   [[r["batch"], r["policy"], r["repeats"], f"{r['mean_s']:.3f} ({r['mean_s_min']:.3f}-"
                     f"{r['mean_s_max']:.3f})", r["p50_s"], r["p90_s"],
                     f"{r['p99_s']:.3f} ({r['p99_s_min']:.3f}-{r['p99_s_max']:.3f})",
                     f"{_num(r.get('compute_busy_share'))} / {_num(r.get('io_busy_share'))}"]
                    for r in aggregate(body["runs"])]),
             "", *_bound_section(body.get("bounds", []), table),
             "## Simulator vs measured restore time (per request, the median of its repeated runs)", "",
             table(["batch", "policy", "mean real (s)", "mean sim (s)", "error of mean", "median error",
                    "worst error", "one run vs median: median / worst"],
                   [[e["batch"], e["policy"], e["mean_restore_real_s"], e["mean_restore_sim_s"], e["mean_rel_error"],
                     e["median_rel_error"], e["max_rel_error"],
                     f"{e['run_median_rel_spread']:.3f} / {e['run_max_rel_spread']:.3f}"]
                    for e in body["sim_validation"]]),
             "", f"## Simulator at cluster scale (8 stages, 8 channels; {body['cluster_requests']} "
             f"requests, arrival times x{body['cluster_time_scale']}): TTFT (s)", "",
             table(["Tio/Tcomp", "batch", "policy", "mean", "P50", "P90", "P99"],
                   [[r["tio_over_tcomp"], r["batch"], r["policy"], r["mean_s"], r["p50_s"], r["p90_s"], r["p99_s"]]
                    for r in body["cluster_scale"]]), ""]
    path.write_text("\n".join(lines))


def _bound_section(bounds: list[dict[str, Any]], table: Callable[..., str]) -> list[str]:
    """Each policy's mean and slowest-request TTFT over the batch bound (the calibrated cost model's)."""
    if not bounds:
        return []
    rows = [[b["batch"], policy, f"{b['bound_mean_s']:.3f} / {b['bound_max_s']:.3f}", v["mean_over_bound"],
             v["max_over_bound"]] for b in bounds for policy, v in b["policies"].items()]
    return ["## Against the batch bound (`cacheflow_common/sched/bound.py`, on the calibrated cost model)", "",
            "No schedule of these requests can beat the bound: a linear relaxation solved exactly, loose where it "
            "drops the order of units, step granularity and the CPU loads take from the compute loops.", "",
            table(["batch", "policy", "bound mean / slowest (s)", "mean / bound", "slowest / bound"], rows), ""]


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _failures(runs: list[dict[str, Any]]) -> list[str]:
    """Lines naming the runs that were repeated because a request failed, with the coordinator's answer."""
    failed = [r for r in runs if r.get("failed_first_try")]
    if not failed:
        return []
    return ["Runs repeated because a request failed (the repeat's numbers are reported):", "",
            *[f"* batch {r['batch']}, {r['policy']}, run {r['repeat'] + 1}: {r['failed_first_try']}" for r in failed],
            ""]


def write_plot(path: Path, runs: list[dict[str, Any]], scale: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    medians = aggregate(runs)
    policies = sorted({r["policy"] for r in medians})
    batches = sorted({r["batch"] for r in medians})
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        rows = [_row(medians, bt, policy) for bt in batches]
        a.bar([x + i * width for x in range(len(batches))], [r["p99_s"] if r else 0 for r in rows], width,
              label=policy)
        sim = [r for r in scale if r["policy"] == policy and r["tio_over_tcomp"] == 1.0]
        b.plot([r["batch"] for r in sim], [r["mean_s"] for r in sim], marker="o", label=policy)
    a.set_xticks([x + 0.4 - width / 2 for x in range(len(batches))], [f"batch {bt}" for bt in batches])
    a.set(ylabel="P99 TTFT (s)", title="local cluster (measured, median of runs)")
    b.set(xscale="log", xlabel="batch", ylabel="mean TTFT (s)", title="simulator, 8 stages, Tio/Tcomp = 1")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
