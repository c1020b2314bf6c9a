"""The report's figures, each drawn from one benchmark's result rows."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cacheflow_bench.batch_report import by_batch_and_policy
from cacheflow_bench.batch_report import write_plot as batch_sizes  # Fig. 9 is the batch benchmark's own plot

__all__ = ["ablation", "batch_sizes", "by_length", "link_sweep", "ttft_cdf", "utilization"]
POLICY_ORDER = ("compute-only", "load-only", "cake", "cacheflow-token", "cacheflow-layer", "cacheflow")
ABLATION = ("cacheflow-token", "cacheflow-layer", "cacheflow")


@contextmanager
def figure(path: Path, rows: int, cols: int, size: tuple[float, float]) -> Iterator[Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=size, squeeze=False, layout="constrained")
    yield axes
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _policies(names: set[str]) -> list[str]:
    return [p for p in POLICY_ORDER if p in names]


def ttft_cdf(path: Path, runs: list[dict[str, Any]]) -> None:
    batch = max(r["batch"] for r in runs)
    with figure(path, 1, 1, (6, 4)) as axes:
        ax = axes[0][0]
        for (b, policy), repeats in by_batch_and_policy(runs).items():
            if b == batch:  # every repeat's requests pooled
                xs = sorted(q["ttft_s"] for run in repeats for q in run["requests"])
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=policy)
        ax.set(xlabel="TTFT (s)", ylabel="share of requests", title=f"TTFT CDF, batch {batch} (measured, all runs)")
        ax.grid(alpha=0.3)
        ax.legend()


def utilization(path: Path, scale: list[dict[str, Any]]) -> None:
    rows = [r for r in scale if r["tio_over_tcomp"] == 1.0]
    policies = _policies({r["policy"] for r in rows})
    panels = (("stage_utilization", "compute (stages)"), ("channel_utilization", "I/O (channels)"),
              ("computed_fraction", "share of tokens recomputed"))
    batches = sorted({r["batch"] for r in rows})
    with figure(path, 1, 3, (13, 3.8)) as axes:
        for ax, (key, title) in zip(axes[0], panels, strict=True):
            for policy in policies:
                mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["batch"])
                ax.plot([r["batch"] for r in mine], [r[key] for r in mine], marker="o", label=policy)
            ax.set(xscale="log", xlabel="batch cap", ylim=(0, 1.05), title=f"{title} (simulated)")
            ax.minorticks_off()
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.grid(alpha=0.3)
        axes[0][0].legend()


def _models(cells: list[dict[str, Any]]) -> list[str]:
    return sorted({c["model"] for c in cells})


def by_length(path: Path, cells: list[dict[str, Any]]) -> None:
    models = _models(cells)
    with figure(path, 1, len(models), (5.5 * len(models), 4)) as axes:
        for ax, model in zip(axes[0], models, strict=True):
            mine = sorted((c for c in cells if c["model"] == model and c["ratio"] == 1), key=lambda c: c["n_tokens"])
            for policy in _policies(set(mine[0]["times_s"])) if mine else []:
                ax.plot([c["n_tokens"] for c in mine], [c["times_s"][policy] for c in mine], marker="o", label=policy)
            ax.plot([c["n_tokens"] for c in mine], [c["bound_s"] for c in mine], "k--", label="bound")
            ax.set(xscale="log", yscale="log", xlabel="prefix tokens", ylabel="restore time (s)",
                   title=f"{model}, Tio/Tcomp = 1")
            ax.minorticks_off()
            ax.set_xticks([c["n_tokens"] for c in mine], [str(c["n_tokens"]) for c in mine])
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)


def ablation(path: Path, cells: list[dict[str, Any]]) -> None:
    models = _models(cells)
    with figure(path, len(models), len(ABLATION), (4.2 * len(ABLATION), 3.4 * len(models))) as axes:
        for row, model in zip(axes, models, strict=True):
            mine = [c for c in cells if c["model"] == model]
            lengths, ratios = sorted({c["n_tokens"] for c in mine}), sorted({c["ratio"] for c in mine})
            for ax, policy in zip(row, ABLATION, strict=True):
                grid = [[_ratio_to_bound(mine, n, r, policy) for r in ratios] for n in lengths]
                image = ax.imshow(grid, vmin=1.0, vmax=1.6, cmap="viridis_r", origin="lower", aspect="auto")
                for i, values in enumerate(grid):
                    for j, v in enumerate(values):
                        ax.text(j, i, f"{v:.2f}" if v == v else "-", ha="center", va="center", fontsize=7, color="w")
                ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
                ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
                ax.set(xlabel="Tio/Tcomp", ylabel="prefix tokens", title=f"{model}: {policy} / bound")
        axes[0][-1].figure.colorbar(image, ax=axes[:, -1].tolist(), shrink=0.8)


def _ratio_to_bound(cells: list[dict[str, Any]], n: int, ratio: float, policy: str) -> float:
    cell = next((c for c in cells if c["n_tokens"] == n and c["ratio"] == ratio), None)
    return float(cell["ratio_to_bound"].get(policy, float("nan"))) if cell else float("nan")


def link_sweep(path: Path, cells: list[dict[str, Any]]) -> None:
    models = _models(cells)
    with figure(path, len(models), 2, (11, 3.6 * len(models))) as axes:
        for row, model in zip(axes, models, strict=True):
            mine = [c for c in cells if c["model"] == model]
            lengths = sorted({c["n_tokens"] for c in mine})
            for ax, n in zip(row, (lengths[0], lengths[-1]), strict=True):
                sweep = sorted((c for c in mine if c["n_tokens"] == n), key=lambda c: c["ratio"])
                for policy in _policies(set(sweep[0]["times_s"])):
                    ax.plot([c["ratio"] for c in sweep], [c["times_s"][policy] for c in sweep], marker="o",
                            label=policy)
                ax.plot([c["ratio"] for c in sweep], [c["bound_s"] for c in sweep], "k--", label="bound")
                ax.set(xscale="log", yscale="log", xlabel="Tio/Tcomp (slower link ->)", ylabel="restore time (s)",
                       title=f"{model}, {n} tokens")
                ax.minorticks_off()
                ax.set_xticks([c["ratio"] for c in sweep], [f"{c['ratio']:g}" for c in sweep])
                ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
