"""The demo's results: a table on the terminal, and a Markdown report, a JSON file and a TTFT CDF plot."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from cacheflow_bench.common import command_line, machine_facts, markdown_table, write_json
from cacheflow_common.sched.policies import POLICIES
from cacheflow_common.sim.replay import ReplayRequest
from cacheflow_services.local_cluster import ClusterSpec

COLUMNS = ["policy", "mean TTFT (s)", "P50 (s)", "max (s)", "vs compute-only (mean)"]
POLICY_KEY = {  # what each policy stands for, in the report and on the terminal
    "compute-only": "recomputes the whole cached prefix: what vLLM does on a cache miss",
    "load-only": "loads the whole prefix's KV from storage: what LMCache does",
    "cake": "Cake, CacheFlow's token-wise predecessor: compute from the front, load from the back, claimed greedily",
    "cacheflow": "CacheFlow: the same two pointers, planned to meet where compute and I/O actually meet, "
                 "token-wise or layer-wise by the profiled L_delta; each compute step advances the shortest and "
                 "the oldest requests, the channels serve the oldest",
    "cacheflow-srpt": "CacheFlow with the rule it replaced: every request in every step, the channels to the "
                      "least recomputation left",
    "cacheflow-token": "CacheFlow, token-wise only",
    "cacheflow-layer": "CacheFlow, layer-wise only (the front layers recomputed, the back ones loaded)",
}
STYLES = [("-", "o"), ("--", "s"), ("-.", "^"), (":", "D"), ("-", "v"), ("--", "x")]  # line, marker per policy


def table_rows(runs: list[dict[str, Any]]) -> list[list[Any]]:
    base = next((r["mean_s"] for r in runs if r["policy"] == "compute-only"), None)
    return [[r["policy"], r["mean_s"], r["p50_s"], r["max_s"], f"{base / r['mean_s']:.2f}x" if base else "-"]
            for r in runs]


def key_lines(runs: list[dict[str, Any]]) -> list[str]:
    return [f"{r['policy']}: {POLICY_KEY.get(r['policy']) or POLICIES[r['policy']].summary}" for r in runs]


def print_key(runs: list[dict[str, Any]]) -> None:
    print("\n".join(["", *key_lines(runs)]))


def print_table(runs: list[dict[str, Any]]) -> None:
    rows = [COLUMNS] + [[c if isinstance(c, str) else f"{c:.3f}" for c in row] for row in table_rows(runs)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def write_report(out: Path, runs: list[dict[str, Any]], *, requests: list[ReplayRequest], spec: ClusterSpec
                 ) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "demo.md", "png": out / "demo.png", "json": out / "demo.json"}
    facts = machine_facts()
    rounds = len({r["round"] for r in runs[0]["requests"]})
    body = {"machine": facts, "command": command_line(), "model": spec.model, "link_gbps_per_pod": spec.rate_gbps,
            "cluster": asdict(spec), "runs": runs,
            "requests": [{"id": r.trace.request_id, "arrival_s": r.trace.arrival_s, "tokens": r.trace.input_length,
                          "cached": r.trace.cached_tokens} for r in requests]}
    write_json(paths["json"], body)
    lines = ["# CacheFlow demo: TTFT per restore policy", "",
             f"Machine: {facts['cpu']}, {facts['cpus']} CPUs. Model {spec.model}, {spec.stages} stage workers, "
             f"{spec.pods} filesystem storage pods shaped to {spec.rate_gbps * 1000:.1f} Mbit/s each (Tio/Tcomp "
             "about 1 for a lone restore), "
             f"chunks of {spec.chunk_size} tokens. {len(requests)} requests of the Mooncake conversation trace "
             f"({sum(r.trace.cached_tokens for r in requests)} of {sum(r.trace.input_length for r in requests)} "
             "tokens cached), replayed at their arrival times: one warm-up replay (not reported), then "
             f"{rounds} per policy, the policies interleaved (their order rotated each round). TTFTs over "
             f"{len(runs[0]['requests'])} requests per policy: max is the slowest (too few requests for a P99). "
             f"Command: `{body['command']}`.", "",
             markdown_table(COLUMNS, table_rows(runs)), "", *[f"* {line}" for line in key_lines(runs)], "",
             "![TTFT CDF](demo.png)", ""]
    paths["md"].write_text("\n".join(lines))
    write_cdf_plot(paths["png"], runs)
    return paths


def write_cdf_plot(path: Path, runs: list[dict[str, Any]]) -> None:
    fig = cdf_figure(runs)  # selects the Agg backend before pyplot is imported
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)


def cdf_figure(runs: list[dict[str, Any]]) -> Any:
    """TTFT CDF per policy, from 0 s; each policy its own line style and marker, so overlaps stay apart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run, (line, marker) in zip(runs, STYLES * len(runs), strict=False):
        xs = sorted(r["ttft_s"] for r in run["requests"])
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=run["policy"],
                linestyle=line, marker=marker, markersize=4, alpha=0.85)
    ax.set_xlim(left=0)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF per restore policy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
