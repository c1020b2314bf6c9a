"""The single-request bench's summary, Markdown and plot, from its cells (see restore_single.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheflow_bench.common import markdown_table, median

POLICIES = ("compute-only", "load-only", "cake", "cacheflow-token", "cacheflow-layer", "cacheflow")
TARGETS = {"max_ratio_to_bound": 1.15, "ratio_to_best_baseline_at_balance": 0.6, "max_adaptive_regret": 0.10}


def summarize(cells: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The targets, CacheFlow and Cake side by side, and whether T* is steady enough to judge them."""
    balance = [c for c in cells if c["ratio"] == 1.0]
    spreads = [c["bound_spread"] for c in cells]
    worst = max(c["ratio_to_bound"]["cacheflow"] for c in cells)
    bound_spread = median(spreads)
    return {
        "max_ratio_to_bound": worst,
        "max_cake_ratio_to_bound": max(c["ratio_to_bound"]["cake"] for c in cells),
        "median_ratio_to_bound": median([c["ratio_to_bound"]["cacheflow"] for c in cells]),
        "median_cake_ratio_to_bound": median([c["ratio_to_bound"]["cake"] for c in cells]),
        "bound_spread": bound_spread,
        "bound_spread_max": max(spreads),
        "within_bound_resolvable": abs(worst - 1) > bound_spread,
        "ratio_to_best_baseline_at_balance": _worst(balance, "cacheflow"),
        "cake_to_best_baseline_at_balance": _worst(balance, "cake"),
        "cacheflow_vs_cake_at_balance": median([_vs_cake(c) for c in balance]) if balance else None,
        "cacheflow_vs_cake_median": median([_vs_cake(c) for c in cells]),
        "cacheflow_vs_cake_max": max(_vs_cake(c) for c in cells),
        "cacheflow_beats_cake_cells": sum(_vs_cake(c) < 1 for c in cells),
        "max_adaptive_regret": max(t["cacheflow"] / min(t["cacheflow-token"], t["cacheflow-layer"]) - 1
                                   for t in (c["times_s"] for c in cells)),
        "targets": TARGETS,
        "cells": len(cells),
    }


def _best_single(cell: dict[str, Any]) -> float:
    return min(cell["times_s"]["compute-only"], cell["times_s"]["load-only"])


def _worst(cells: Sequence[dict[str, Any]], policy: str) -> float | None:
    return max((c["times_s"][policy] / _best_single(c) for c in cells), default=None)


def _vs_cake(cell: dict[str, Any]) -> float:
    return cell["times_s"]["cacheflow"] / cell["times_s"]["cake"]


def render_markdown(body: dict[str, Any]) -> str:
    s, m = body["summary"], body["machine"]
    return "\n".join([
        "# Single-request restore vs the optimal bound, CacheFlow beside Cake", "",
        f"Machine: {m['cpu']}, {m['cpus']} CPUs, torch {m['torch']} with {m['torch_threads']} threads"
        + (f", GPU {m['gpu']}" if m["gpu"] else ", no GPU") + f"; git {m['git']}.",
        f"Command: `{body['command']}`. Times in seconds (median of {body['settings']['repeats']} interleaved "
        "repeats).", "", *_targets(s), "", *_baselines(body), "", _cells_table(body["cells"]), "",
    ])


def _targets(s: dict[str, Any]) -> list[str]:
    rows = [
        ["time / T*, worst cell", s["max_ratio_to_bound"], s["max_cake_ratio_to_bound"], "<= 1.15"],
        ["time / T*, median cell", s["median_ratio_to_bound"], s["median_cake_ratio_to_bound"], ""],
        ["time / the better of compute-only and load-only at Tio/Tcomp = 1, worst cell",
         _fmt(s["ratio_to_best_baseline_at_balance"]), _fmt(s["cake_to_best_baseline_at_balance"]), "<= 0.6"],
        ["CacheFlow / Cake at Tio/Tcomp = 1, median cell", _fmt(s["cacheflow_vs_cake_at_balance"]), "1", "< 1"],
        ["CacheFlow / Cake, median over all cells (worst)",
         f"{s['cacheflow_vs_cake_median']:.3f} ({s['cacheflow_vs_cake_max']:.3f})", "1", "< 1"],
        ["adaptive vs the better of token/layer, worst regret", s["max_adaptive_regret"], "", "<= 0.10"],
    ]
    verdict = (f"T* itself varies by {s['bound_spread']:.3f} between repeats (median cell; worst "
               f"{s['bound_spread_max']:.3f}). ")
    if s["within_bound_resolvable"]:
        verdict += f"CacheFlow's worst distance from T*, {abs(s['max_ratio_to_bound'] - 1):.3f}, is larger: resolvable."
    else:
        verdict += (f"CacheFlow's worst distance from T*, {abs(s['max_ratio_to_bound'] - 1):.3f}, is within that "
                    "spread: **not resolvable** on this machine (no claim of distance to optimal is made).")
    cake = ("CacheFlow beats Cake in {0} of {1} cells." if s["cacheflow_beats_cake_cells"] * 2 > s["cells"] else
            "**CacheFlow does not beat Cake** in most cells: it is faster in {0} of {1}.")
    return [markdown_table(["measure", "CacheFlow", "Cake", "goal"], rows), "", verdict,
            cake.format(s["cacheflow_beats_cake_cells"], s["cells"])]


def _baselines(body: dict[str, Any]) -> list[str]:
    chunk = body["settings"]["chunk_size"]
    return [
        "Baselines, each at its strongest:",
        "- **compute-only**: the runtime's fastest recompute of the prefix, chosen per length from chunks of "
        f"{chunk} and 1,024 tokens and the whole prefix in one prefill (measured after a warm-up; the chosen "
        "chunk is in the table).",
        "- **load-only**: every unit read with 2 reads in flight, so the link never waits for a landing; the "
        "better of token and layer order (in the table).",
        f"- **Cake**: token-wise two pointers over {chunk}-token chunks, compute from the front, one read in flight "
        "from the back, as in its paper.",
        "- **T\\***: per repeat, from that repeat's per-unit compute (restore chunks, and layers) and load "
        "(load-only's time between completions) costs: the best split in token or in layer order, or the "
        "compute-only run if faster; the median over repeats, with its spread ((max - min) / median).",
        "- **Links are emulated**: one token-bucket-shaped store per cell, its rate chosen so that loading the "
        f"prefix takes Tio/Tcomp times its recompute in {chunk}-token chunks.",
    ]


def _cells_table(cells: Sequence[dict[str, Any]]) -> str:
    header = ["model", "N", "Tio/Tcomp", "link Mbit/s (emulated)", "compute-only (chunk)", "load-only (order)",
              "cake", "cacheflow-token", "cacheflow-layer", "cacheflow", "mode", "T* (spread)", "CF / T*",
              "Cake / T*", "CF / Cake"]
    rows = []
    for c in cells:
        t, b = c["times_s"], c["baselines"]
        rows.append([c["model"], c["n_tokens"], c["ratio"], f"{c['link_gbps'] * 1000:.1f}",
                     f"{t['compute-only']:.3f} ({b['compute_only_chunk']})",
                     f"{t['load-only']:.3f} ({b['load_only_order']})", t["cake"], t["cacheflow-token"],
                     t["cacheflow-layer"], t["cacheflow"], c["adaptive_mode"],
                     f"{c['bound_s']:.3f} ({c['bound_spread']:.2f})", c["ratio_to_bound"]["cacheflow"],
                     c["ratio_to_bound"]["cake"], _vs_cake(c)])
    return markdown_table(header, rows)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def plot(cells: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({c["model"] for c in cells})
    lengths = sorted({c["n_tokens"] for c in cells})
    fig, axes = plt.subplots(len(models), len(lengths), figsize=(3.2 * len(lengths), 2.8 * len(models)),
                             squeeze=False, sharey=True)
    for i, m in enumerate(models):
        for j, n in enumerate(lengths):
            ax = axes[i][j]
            sel = sorted((c for c in cells if c["model"] == m and c["n_tokens"] == n), key=lambda c: c["ratio"])
            if not sel:  # a length capped for this model
                ax.set_visible(False)
                continue
            for p in POLICIES:
                ax.plot([c["ratio"] for c in sel], [c["ratio_to_bound"][p] for c in sel], marker="o", label=p)
            ax.axhline(1.15, color="grey", ls=":", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{m}, N={n}", fontsize=9)
            ax.set_xlabel("Tio/Tcomp")
            if j == 0:
                ax.set_ylabel("time / bound T*")
    axes[0][0].set_ylim(0.8, 4.5)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
