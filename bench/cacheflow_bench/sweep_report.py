"""The trace sweep's report: its headline keys (the batch scheduler's targets), the Markdown tables and the
plot of each policy's TTFT over the load levels."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

LOADED = ("medium", "overload")  # the levels where requests overlap enough to schedule


def summary_keys(rows: list[dict[str, Any]], policies: list[str]) -> dict[str, float]:
    """CacheFlow against Cake and the bound, over windows: worst at the loaded levels, worst at light, median at
    overload; and the calibrated simulator's error, where the rows have one (the cluster sweep)."""
    def ratios(level_names: tuple[str, ...], key: str, against: str = "cake") -> list[float]:
        return [r["cacheflow"][key] / r[against][key] for r in rows if r["level"] in level_names]

    out = {
        "sweep_worst_mean_ratio_vs_cake": max(ratios(LOADED, "mean_s")),
        "sweep_worst_max_ratio_vs_cake": max(ratios(LOADED, "max_s")),
        "sweep_light_worst_mean_ratio_vs_cake": max(ratios(("light",), "mean_s")),
        "sweep_overload_median_mean_ratio_vs_cake": statistics.median(ratios(("overload",), "mean_s")),
        "sweep_overload_median_mean_ratio_vs_bound": statistics.median(ratios(("overload",), "mean_s", "bound")),
    }
    errors = [r[p]["sim_mean_rel_error"] for r in rows for p in policies if "sim_mean_rel_error" in r[p]]
    if errors:
        out |= {"sweep_sim_mean_rel_error": statistics.fmean(errors), "sweep_sim_max_rel_error": max(errors)}
    return out


def report(body: dict[str, Any], doc: str) -> str:
    policies = body["policies"]
    where = "simulated" if body["simulated"] else f"local cluster, {body['rounds']} rounds per policy"
    about = " ".join(doc.split("\n\n")[1].split())
    lines = [f"# Trace sweep ({where})\n\nCommand: `{body['command']}`. {about}"
             f"\n\nWindows: {body['windows']} of {body['requests']} requests (trace lines "
             f"{body['lines'][0]}..{body['lines'][1]}). Ratios per window; worst (max) and median over windows.\n",
             "\n## Headline (CacheFlow)\n", "| key | value |", "|---|---|"]
    lines += [f"| `{k}` | {v:.3f} |" for k, v in body["headline"].items()]
    for level, per in body["summary"].items():
        lines.append(f"\n## {level} (arrivals x{body['levels'][level]})\n")
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
    levels = list(body["levels"])
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
