"""The batch benchmark's summary, tables and plot."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


def _run(runs: list[dict[str, Any]], batch: int, policy: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["batch"] == batch and r["policy"] == policy), None)


def summary_of(runs: list[dict[str, Any]], errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The targets at the largest batch replayed (8 by default): measured on the local cluster."""
    batch = max(r["batch"] for r in runs)
    cf, cake, compute = (_run(runs, batch, p) for p in ("cacheflow", "cake", "compute-only"))
    return {
        "batch": batch,
        "p99_ratio_vs_cake_b8": cf["p99_s"] / cake["p99_s"] if cf and cake else None,
        "mean_speedup_vs_compute_only_b8": compute["mean_s"] / cf["mean_s"] if cf and compute else None,
        "sim_max_rel_error": max(e["max_rel_error"] for e in errors) if errors else None,
        "sim_median_rel_error": sorted(e["median_rel_error"] for e in errors)[len(errors) // 2] if errors else None,
        "sim_max_mean_error": max(e["mean_rel_error"] for e in errors) if errors else None,
    }


def write_markdown(path: Path, body: dict[str, Any], table: Callable[..., str]) -> None:
    s, facts = body["summary"], body["machine"]
    lines = ["# Batch restore on the local cluster and in the simulator", "",
             f"Machine: {facts['cpu']}, {facts['cpus']} CPUs; git {facts['git']}. Command: `{body['command']}`.",
             f"{len(body['requests'])} trace requests, link {body['link_gbps_per_pod']:.4f} Gbit/s per pod "
             "(Tio/Tcomp = 1 per stage). Simulator calibration (the shortest and the median request restored "
             f"alone, measured / profiled): compute x{body['calibration']['compute']:.2f}, "
             f"load x{body['calibration']['load']:.2f}, plus {body['calibration'].get('overhead_s', 0.0):.3f} s "
             "per restore outside the two pointers. Simulated requests enter the admission queue when the real "
             "ones did (after their prefix lookup).",
             "",
             table(["target", "measured", "goal"], [
                 [f"CacheFlow P99 TTFT / Cake's, batch {s['batch']}", s["p99_ratio_vs_cake_b8"], "<= 0.75"],
                 [f"compute-only mean TTFT / CacheFlow's, batch {s['batch']}", s["mean_speedup_vs_compute_only_b8"],
                  ">= 1.6"],
                 ["simulator: worst per-request restore-time error", s["sim_max_rel_error"], "<= 0.15"],
                 ["simulator: median per-request restore-time error (median run)", s["sim_median_rel_error"], ""],
                 ["simulator: worst error of a run's mean restore time", s["sim_max_mean_error"], ""],
             ]), "", "## Local cluster: TTFT (s)", "",
             table(["batch", "policy", "mean", "P50", "P90", "P99"],
                   [[r["batch"], r["policy"], r["mean_s"], r["p50_s"], r["p90_s"], r["p99_s"]] for r in body["runs"]]),
             "", "## Simulator vs measured restore time", "",
             table(["batch", "policy", "mean real (s)", "mean sim (s)", "error of mean", "median error",
                    "worst error"],
                   [[e["batch"], e["policy"], e["mean_restore_real_s"], e["mean_restore_sim_s"], e["mean_rel_error"],
                     e["median_rel_error"], e["max_rel_error"]] for e in body["sim_validation"]]),
             "", f"## Simulator at cluster scale (8 stages, 8 channels; {body.get('cluster_requests', '')} "
             f"requests, arrival times x{body.get('cluster_time_scale', '')}): TTFT (s)", "",
             table(["Tio/Tcomp", "batch", "policy", "mean", "P50", "P90", "P99"],
                   [[r["tio_over_tcomp"], r["batch"], r["policy"], r["mean_s"], r["p50_s"], r["p90_s"], r["p99_s"]]
                    for r in body["cluster_scale"]]), ""]
    path.write_text("\n".join(lines))


def write_plot(path: Path, runs: list[dict[str, Any]], scale: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    policies = sorted({r["policy"] for r in runs})
    batches = sorted({r["batch"] for r in runs})
    width = 0.8 / len(policies)
    for i, policy in enumerate(policies):
        rows = [_run(runs, bt, policy) for bt in batches]
        a.bar([x + i * width for x in range(len(batches))], [r["p99_s"] if r else 0 for r in rows], width,
              label=policy)
        sim = [r for r in scale if r["policy"] == policy and r["tio_over_tcomp"] == 1.0]
        b.plot([r["batch"] for r in sim], [r["mean_s"] for r in sim], marker="o", label=policy)
    a.set_xticks([x + 0.4 - width / 2 for x in range(len(batches))], [f"batch {bt}" for bt in batches])
    a.set(ylabel="P99 TTFT (s)", title="local cluster (measured)")
    b.set(xscale="log", xlabel="batch", ylabel="mean TTFT (s)", title="simulator, 8 stages, Tio/Tcomp = 1")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
