"""The demo's results: a table on the terminal, and a Markdown report, a JSON file and a TTFT CDF plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cacheflow_bench.common import command_line, machine_facts, markdown_table, write_json
from cacheflow_common.sched.policies import POLICIES
from cacheflow_common.sim.replay import ReplayRequest
from cacheflow_services.local_cluster import ClusterSpec

COLUMNS = ["policy", "mean TTFT (s)", "P50 (s)", "max (s)", "round means (s)", "speed-up over compute-only (mean)"]
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


@dataclass(frozen=True)
class LinkChoice:
    """Each storage pod's link rate, and how it was chosen (on the terminal and in the report)."""

    gbps: float
    how: str
    profile_gbps: float | None = None  # the rate the profile balances (None: given with --link-gbps)
    measured_io_over_compute: float | None = None  # a lone restore's Tio/Tcomp at profile_gbps on the cluster

    def said(self) -> str:
        return f"links of {self.gbps * 1000:.1f} Mbit/s per storage pod, {self.how}"


def table_rows(runs: list[dict[str, Any]]) -> list[list[Any]]:
    base = next((r["mean_s"] for r in runs if r["policy"] == "compute-only"), None)
    return [[r["policy"], r["mean_s"], r["p50_s"], r["max_s"], spread(r["round_means_s"]),
             f"{base / r['mean_s']:.2f}x" if base else "-"] for r in runs]


def spread(values: list[float]) -> str:
    """A range of times, "4.91-5.32", or the one value."""
    low, high = min(values), max(values)
    return f"{low:.2f}" if len(values) == 1 else f"{low:.2f}-{high:.2f}"


def ratios_to_cake(runs: list[dict[str, Any]]) -> dict[str, float | None]:
    """CacheFlow's TTFT over Cake's, on the mean and on the slowest request (below 1: CacheFlow faster);
    None where either policy was not replayed."""
    by_policy = {r["policy"]: r for r in runs}
    both = "cacheflow" in by_policy and "cake" in by_policy
    return {f"cacheflow_vs_cake_{name}": by_policy["cacheflow"][key] / by_policy["cake"][key] if both else None
            for name, key in (("mean", "mean_s"), ("slowest", "max_s"))}


def verdict(runs: list[dict[str, Any]]) -> str:
    """Who won on the mean TTFT (and whether by more than the rounds' spread), who on the slowest request,
    and CacheFlow against Cake."""
    first, *rest = sorted(runs, key=lambda r: r["mean_s"])
    said = f"{first['policy']} won on mean TTFT: {first['mean_s']:.2f} s"
    if rest:
        gap = rest[0]["mean_s"] - first["mean_s"]
        noise = max(max(r["round_means_s"]) - min(r["round_means_s"]) for r in (first, rest[0]))
        margin = "a clear margin" if gap > noise else "not a clear win"
        said += (f", {gap:.2f} s ahead of {rest[0]['policy']} (the round means of either spread by up to "
                 f"{noise:.2f} s: {margin})")
    slowest = min(runs, key=lambda r: r["max_s"])
    said += f". Fastest slowest request: {slowest['policy']}, {slowest['max_s']:.2f} s."
    ratios = ratios_to_cake(runs)
    if ratios["cacheflow_vs_cake_mean"] is not None:
        said += (f" CacheFlow / Cake: {ratios['cacheflow_vs_cake_mean']:.3f}x on the mean, "
                 f"{ratios['cacheflow_vs_cake_slowest']:.3f}x on the slowest request (below 1: CacheFlow faster).")
    return said


def print_verdict(runs: list[dict[str, Any]]) -> None:
    print(f"\n{verdict(runs)}")


def key_lines(runs: list[dict[str, Any]]) -> list[str]:
    return [f"{r['policy']}: {POLICY_KEY.get(r['policy']) or POLICIES[r['policy']].summary}" for r in runs]


def print_key(runs: list[dict[str, Any]]) -> None:
    print("\n".join(["", *key_lines(runs)]))


def print_table(runs: list[dict[str, Any]]) -> None:
    rows = [COLUMNS] + [[c if isinstance(c, str) else f"{c:.3f}" for c in row] for row in table_rows(runs)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))


def write_report(out: Path, runs: list[dict[str, Any]], *, requests: list[ReplayRequest], spec: ClusterSpec,
                 link: LinkChoice) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "demo.md", "png": out / "demo.png", "json": out / "demo.json"}
    facts = machine_facts()
    rounds = len({r["round"] for r in runs[0]["requests"]})
    body = {"machine": facts, "command": command_line(), "model": spec.model,
            "summary": {"verdict": verdict(runs), **ratios_to_cake(runs)},
            "link_gbps_per_pod": link.gbps, "link": asdict(link), "cluster": asdict(spec), "runs": runs,
            "requests": [{"id": r.trace.request_id, "arrival_s": r.trace.arrival_s, "tokens": r.trace.input_length,
                          "cached": r.trace.cached_tokens} for r in requests]}
    write_json(paths["json"], body)
    lines = ["# CacheFlow demo: TTFT per restore policy", "",
             f"Machine: {facts['cpu']}, {facts['cpus']} CPUs. Model {spec.model}, {spec.stages} stage workers, "
             f"{spec.pods} filesystem storage pods, {link.said()} (`--link-gbps {link.gbps:.6g}` reruns at this "
             f"rate), chunks of {spec.chunk_size} tokens. {len(requests)} requests of the Mooncake conversation trace "
             f"({sum(r.trace.cached_tokens for r in requests)} of {sum(r.trace.input_length for r in requests)} "
             "tokens cached), replayed at their arrival times: one warm-up replay (not reported), then "
             f"{rounds} per policy, the policies interleaved (their order rotated each round). TTFTs over "
             f"{len(runs[0]['requests'])} requests per policy: max is the slowest (too few requests for a P99). "
             f"Command: `{body['command']}`.", "",
             f"**{verdict(runs)}**", "",
             markdown_table(COLUMNS, table_rows(runs)), "",
             "Round means: the lowest and highest of the rounds' mean TTFTs (their spread is how far one replay "
             "may land from the next). Speed-up over compute-only: compute-only's mean TTFT over the policy's.", "",
             *[f"* {line}" for line in key_lines(runs)], "",
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
