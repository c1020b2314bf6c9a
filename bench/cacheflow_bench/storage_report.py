"""The storage benchmark's Markdown table and plot (`storage.md`, `storage.png`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cacheflow_bench.common import command_line, machine_facts, markdown_table

Rows = list[dict[str, Any]]


def write_markdown(path: Path, summary: dict[str, Any], shaped: Rows, raws: Rows, loads: Rows) -> None:
    facts = machine_facts()
    memcpy = summary["memcpy_cpu_s_per_gb"]
    lines = ["# Storage data plane", "",
             f"Machine: {facts['cpu']}, {facts['cpus']} CPUs; git {facts['git']}. Command: `{command_line()}`.", "",
             "Shaped rates are emulated links: each pod's token bucket, at the configured rates (`--rates`: those "
             "up to half the raw rate this host reaches count towards the target); raw and loader rates are "
             "loopback, unshaped. No real network link is measured here. A loader reads a chunk into a KV buffer, "
             "checked and landed, as a restore does; its CPU is the pod's and the loader's together.", "",
             markdown_table(["target", "measured", "goal"], [
                 ["worst shaped-rate error, sustainable rates", summary["max_shaping_error"], "<= 0.05"],
                 ["worst shaped-rate error, all rates", summary["max_shaping_error_all_rates"], ""],
                 ["one loader over TCP, worst size (GB/s)", summary["loader_gb_per_s_tcp"], ">= 5"],
                 ["one loader over NIXL / over TCP, worst size", summary["nixl_vs_tcp_throughput_min"] or "-", ">= 1"],
                 ["CPU-s per GB end to end, worst (pod + loader)", summary["cpu_s_per_gb_end_to_end_max"],
                  f"<= {3 * memcpy:.3f} (3 x memcpy)"],
                 ["memcpy, CPU-s per GB", memcpy, ""],
                 ["plain loopback TCP, no CacheFlow code (GB/s)", summary["socket_ceiling_gb_per_s"], ""],
                 ["plain loopback TCP, CPU-s per GB (both ends)", summary["socket_ceiling_cpu_s_per_gb"], ""],
                 ["idle pod, share of a core (worst transport)", summary["idle_pod_cpu_share_max"], "<= 0.02"],
                 ["raw TCP, largest chunk (Gbit/s)", summary["tcp_gbps"] or "-", ""],
                 ["raw NIXL, largest chunk (Gbit/s)", summary["nixl_gbps"] or "-", ""],
             ]), "",
             "Small (4 KiB) read latency: " + ", ".join(f"{t} {v * 1e6:.0f} us"
                                                        for t, v in summary["small_read_latency_s"].items()), "",
             markdown_table(["transport", "chunk MB", "GB/s", "CPU-s/GB pod", "CPU-s/GB loader", "CPU-s/GB",
                             "x memcpy"],
                            [[r["transport"], r["chunk_mb"], r["gbytes_per_s"], r["pod_cpu_s_per_gb"],
                              r["loader_cpu_s_per_gb"], r["cpu_s_per_gb"], r["cpu_s_per_gb"] / memcpy]
                             for r in loads]), "",
             markdown_table(["transport", "readers", "configured Gbit/s", "achieved Gbit/s", "error", "min share",
                             "sustainable"],
                            [[r["transport"], r["readers"], r["rate_gbps"], r["achieved_gbps"], r["error"],
                              r["min_share"], "yes" if r["sustainable"] else "no"] for r in shaped]), "",
             markdown_table(["transport", "chunk MB", "GB/s", "Gbit/s"],
                            [[r["transport"], r["chunk_mb"], r["gbytes_per_s"], r["gbps"]] for r in raws]), ""]
    path.write_text("\n".join(lines))


def plot(path: Path, shaped: Rows, raws: Rows, loads: Rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for t in sorted({r["transport"] for r in raws}):
        rows = [r for r in raws if r["transport"] == t]
        a.plot([r["chunk_mb"] for r in rows], [r["gbytes_per_s"] for r in rows], marker="o", label=f"{t}, raw")
        rows = [r for r in loads if r["transport"] == t]
        a.plot([r["chunk_mb"] for r in rows], [r["gbytes_per_s"] for r in rows], marker="s", linestyle="--",
               label=f"{t}, loader into KV")
        rows = [r for r in shaped if r["transport"] == t]
        b.scatter([r["rate_gbps"] for r in rows], [r["achieved_gbps"] for r in rows], label=t)
    top = max((r["rate_gbps"] for r in shaped), default=1.0)
    b.plot([0, top], [0, top], "k--", linewidth=0.8, label="configured")
    a.set(xscale="log", xlabel="chunk MB", ylabel="GB/s", title="one reader, unshaped")
    b.set(xlabel="configured Gbit/s", ylabel="achieved Gbit/s", title="shaped aggregate rate")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
