"""The vLLM bench's serving mode: a slice of the Mooncake conversation trace (the batch bench's: lengths /8, at
most 2,048 tokens) replayed through vLLM's OpenAI server at three request rates.

Each column is its own server (`vllm.entrypoints.openai.api_server`, prefix caching off): vLLM's own
recompute, and the connector with load-only, Cake, CacheFlow (restores in the background, the default)
and CacheFlow restoring inside vLLM's step (`async_loads: false`). Every request's cached prefix is stored
once first (a saving server over an unshaped pod); then the pod's link is emulated at the rate that makes
loading the median request's cached prefix take as long as vLLM recomputing it (Tio/Tcomp = 1, from the
recompute measurements). The rates are fractions of vLLM's recompute capacity (one over the mean of each
request's recompute time): light, medium and saturated. At each, the trace's arrival pattern is stretched
to that mean rate, a warm-up request goes first, and every request asks for max_tokens=1: its TTFT is the
client's time from sending to the answer; throughput is requests over the time from the first send to the
last answer. The rates run in one server per column, lightest first.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from cacheflow_bench.common import TRACE
from cacheflow_common.sim import percentile
from cacheflow_common.sim.replay import ReplayRequest, read_records, select_requests

if TYPE_CHECKING:
    from cacheflow_bench.vllm import Bench

# column -> the connector's settings (None: no connector, vLLM's own recompute)
COLUMNS: dict[str, dict[str, Any] | None] = {
    "recompute": None, "load-only": {"policy": "load-only"}, "cake": {"policy": "cake"},
    "cacheflow": {"policy": "cacheflow"}, "cacheflow-sync": {"policy": "cacheflow", "async_loads": False}}
LOADS = {"light": 0.3, "medium": 0.7, "saturated": 1.5}  # request rate / vLLM's recompute capacity
START_S = 300.0  # longest wait for a server to answer /health
TIMEOUT_S = 600.0
PAUSE_S = 2.0  # between two rates on one server


def trace_requests(count: int) -> list[ReplayRequest]:
    records = read_records(TRACE, start=3000, scan=3000)
    return select_requests(records, count=count, token_scale=8, max_tokens=2048, time_scale=1.0)


def at_rate(requests: list[ReplayRequest], rate: float) -> list[ReplayRequest]:
    """The requests with the trace's arrival pattern stretched to `rate` requests per second on average."""
    span = requests[-1].trace.arrival_s - requests[0].trace.arrival_s
    scale = (len(requests) - 1) / rate / span if span > 0 and len(requests) > 1 else 0.0
    first = requests[0].trace.arrival_s
    return [replace(r, trace=replace(r.trace, arrival_s=(r.trace.arrival_s - first) * scale)) for r in requests]


class Server:
    """vLLM's OpenAI server in a subprocess, with the connector or without."""

    def __init__(self, bench: Bench, name: str, connector: dict[str, Any] | None) -> None:
        from cacheflow_bench.vllm import BLOCK, VLLM_PYTHON

        self.model = str(bench.model_dir)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--dtype", "float32", "--skip-tokenizer-init", "--port", str(self.port), "--max-model-len", "16384",
                "--enforce-eager", "--block-size", str(BLOCK), "--no-enable-prefix-caching"]
        if connector is not None:
            from cacheflow_services.vllm_connector.drive import transfer_config

            args += ["--kv-transfer-config", json.dumps(transfer_config(connector))]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2"}
        self.log = (bench.root / f"{name}.server.log").open("w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=bench.root)

    def __enter__(self) -> Server:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"vLLM's server did not start in {START_S:.0f} s; see {self.log.name}")

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def complete(self, token_ids: list[int]) -> tuple[float, int]:
        """(seconds to the answer, the greedy next token) of one max_tokens=1 completion."""
        body = {"model": self.model, "prompt": token_ids, "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True}
        start = time.monotonic()
        answer = httpx.post(f"{self.url}/v1/completions", json=body, timeout=TIMEOUT_S)
        answer.raise_for_status()
        return time.monotonic() - start, int(answer.json()["choices"][0]["token_ids"][0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def replay(server: Server, requests: list[ReplayRequest]) -> tuple[list[tuple[float, int]], float]:
    """Each request sent at its arrival time: its TTFT and next token, in the requests' order, and the time
    from the first send to the last answer."""
    began = time.monotonic()
    answered: list[float] = []

    def send(r: ReplayRequest) -> tuple[float, int]:
        time.sleep(max(0.0, began + r.trace.arrival_s - time.monotonic()))
        outcome = server.complete(r.token_ids)
        answered.append(time.monotonic())
        return outcome

    with ThreadPoolExecutor(max_workers=max(1, len(requests))) as senders:
        outcomes = list(senders.map(send, requests))
    return outcomes, max(answered) - began


def run_trace(bench: Bench, requests: list[ReplayRequest], tcomp: dict[int, float],
              kv_bytes_of: Callable[[int], int], loads: dict[str, float] | None = None) -> dict[str, Any]:
    """Every column's TTFTs at every rate; `tcomp`: vLLM's recompute time by prefix length (seconds)."""
    loads = loads or LOADS
    lengths = sorted(tcomp)
    recompute_s = [float(np.interp(r.trace.input_length, lengths, [tcomp[n] for n in lengths])) for r in requests]
    capacity = 1 / statistics.fmean(recompute_s)  # requests per second vLLM recomputes, one at a time
    rates = {name: share * capacity for name, share in loads.items()}
    bench.start_pod()
    with Server(bench, "trace-save", bench.connector()) as saver:
        for r in requests:
            saver.complete(r.token_ids[: r.trace.cached_tokens + 1])
    median_cached = int(statistics.median(r.trace.cached_tokens for r in requests))
    t_med = float(np.interp(median_cached, lengths, [tcomp[n] for n in lengths]))
    link = kv_bytes_of(median_cached) * 8 / t_med / 1e9
    bench.start_pod(link)
    names = list(COLUMNS)
    columns: dict[str, Any] = {}
    for name in names[1:] + names[:1]:  # recompute last: the saving server ran first
        columns[name] = _column(bench, name, requests, rates, link)
    return {"requests": [{"id": r.trace.request_id, "arrival_s": r.trace.arrival_s, "tokens": r.trace.input_length,
                          "cached": r.trace.cached_tokens} for r in requests],
            "capacity_rps": capacity, "rates_rps": rates, "loads": loads, "rate_gbps": link, "link_emulated": True,
            "columns": columns, "summary": summarize(columns, list(rates))}


def _column(bench: Bench, name: str, requests: list[ReplayRequest], rates: dict[str, float],
            link: float) -> dict[str, Any]:
    """One column's server at every rate, lightest first; with the connector, its restores counted."""
    settings = COLUMNS[name]
    stats = bench.root / f"trace-{name}.stats.jsonl"
    stats.unlink(missing_ok=True)
    connector = None if settings is None else bench.connector(
        **settings, save=False, profile=str(bench.profile), link_gbps=link, stats_file=str(stats))
    by_rate: dict[str, Any] = {}
    with Server(bench, f"trace-{name}", connector) as server:
        server.complete(bench.warm)
        for load, rate in rates.items():
            outcomes, span = replay(server, at_rate(requests, rate))
            ttfts = [t for t, _ in outcomes]
            by_rate[load] = {"rate_rps": rate, "ttft_s": ttfts, "mean_s": statistics.fmean(ttfts),
                             "p50_s": percentile(sorted(ttfts), 50), "p99_s": percentile(sorted(ttfts), 99),
                             "throughput_rps": len(ttfts) / span, "next_tokens": [tok for _, tok in outcomes]}
            time.sleep(PAUSE_S)
    return {"by_rate": by_rate, "units": _units(stats) if settings is not None else None}


def _units(stats: Path) -> dict[str, int]:
    """The column's restores and the units they loaded and computed (the warm-up's included)."""
    restores = [e for e in map(json.loads, stats.read_text().splitlines()) if e["event"] == "restore"] \
        if stats.exists() else []
    return {"restores": len(restores), "loaded": sum(e["loaded"] for e in restores),
            "computed": sum(e["computed"] for e in restores)}


def summarize(columns: dict[str, Any], loads: Sequence[str]) -> dict[str, Any]:
    stat = {name: {load: c["by_rate"][load] for load in loads} for name, c in columns.items()}
    mean_vs_best, p99_vs_best = {}, {}
    for load in loads:
        baselines = [stat[b][load] for b in ("recompute", "load-only")]
        mean_vs_best[load] = stat["cacheflow"][load]["mean_s"] / min(b["mean_s"] for b in baselines)
        p99_vs_best[load] = stat["cacheflow"][load]["p99_s"] / min(b["p99_s"] for b in baselines)
    reference = {load: stat["recompute"][load]["next_tokens"] for load in loads}
    restored = {name: c["units"] for name, c in columns.items() if c["units"] is not None}
    return {"vllm_rate_sweep_worst_mean_ratio_vs_best_baseline": max(mean_vs_best.values()),
            "vllm_rate_sweep_worst_p99_ratio_vs_best_baseline": max(p99_vs_best.values()),
            "vllm_rate_sweep_mean_ratio_vs_best_baseline": mean_vs_best,
            "vllm_rate_sweep_p99_ratio_vs_best_baseline": p99_vs_best,
            "vllm_rate_sweep_mean_ratio_vs_cake": {
                load: stat["cacheflow"][load]["mean_s"] / stat["cake"][load]["mean_s"] for load in loads},
            "vllm_rate_sweep_async_vs_sync_mean": {
                load: stat["cacheflow"][load]["mean_s"] / stat["cacheflow-sync"][load]["mean_s"] for load in loads},
            "vllm_rate_sweep_next_token_matches": all(
                stat[name][load]["next_tokens"] == reference[load] for name in stat for load in loads),
            # every connector column restored (a short prefix may be all loads, its meeting point at 0), and
            # load-only computed nothing
            "vllm_rate_sweep_restores_happened": all(
                u["restores"] > 0 and u["loaded"] + u["computed"] > 0 and (name != "load-only" or not u["computed"])
                for name, u in restored.items()),
            "targets": {"vllm_rate_sweep_worst_mean_ratio_vs_best_baseline": 0.90,
                        "vllm_rate_sweep_worst_p99_ratio_vs_best_baseline": 1.00}}


def report_lines(trace: dict[str, Any]) -> list[str]:
    s, loads = trace["summary"], list(trace["rates_rps"])
    rows = "\n".join(
        f"| {load} ({trace['rates_rps'][load]:.2f}/s) | {name} | {c['mean_s']:.3f} | {c['p50_s']:.3f} | "
        f"{c['p99_s']:.3f} | {c['throughput_rps']:.2f} |"
        for load in loads for name in COLUMNS for c in [trace["columns"][name]["by_rate"][load]])
    ratios = ", ".join(f"{load} {s['vllm_rate_sweep_mean_ratio_vs_best_baseline'][load]:.3f} / "
                       f"{s['vllm_rate_sweep_p99_ratio_vs_best_baseline'][load]:.3f}" for load in loads)
    return [
        f"## Serving: {len(trace['requests'])} Mooncake requests through vLLM's OpenAI server at "
        f"{len(loads)} request rates", "",
        "Lengths /8 (at most 2,048 tokens), the trace's arrival pattern stretched to each rate: "
        + ", ".join(f"{load} {trace['loads'][load]:g}x" for load in loads)
        + f" vLLM's recompute capacity ({trace['capacity_rps']:.2f} requests/s); one pod, its link emulated at "
        f"{trace['rate_gbps']:.3f} Gbit/s (Tio/Tcomp = 1 for the median cached prefix). One run per column and "
        "rate. `cacheflow-sync`: CacheFlow restoring inside vLLM's step (`async_loads: false`).", "",
        "| rate | column | mean TTFT (s) | P50 (s) | P99 (s) | throughput (req/s) |", "|---|---|---|---|---|---|",
        rows, "", "![TTFT against request rate](vllm_rates.png)", "",
        f"CacheFlow mean / P99 against the better of recompute and load-only, per rate: {ratios}; worst "
        f"**{s['vllm_rate_sweep_worst_mean_ratio_vs_best_baseline']:.3f}** (target <= 0.90) / "
        f"**{s['vllm_rate_sweep_worst_p99_ratio_vs_best_baseline']:.3f}** (target <= 1.00). Mean / Cake's: "
        + ", ".join(f"{load} {v:.3f}" for load, v in s["vllm_rate_sweep_mean_ratio_vs_cake"].items())
        + "; background / in-step restores (mean): "
        + ", ".join(f"{load} {v:.3f}" for load, v in s["vllm_rate_sweep_async_vs_sync_mean"].items())
        + f". Greedy next tokens equal vLLM's own in every column: {s['vllm_rate_sweep_next_token_matches']}; "
        f"every connector column restored (units loaded or computed): {s['vllm_rate_sweep_restores_happened']}.",
        ""]


def write_plot(trace: dict[str, Any], path: Path) -> None:
    """Mean (solid) and P99 (dashed) TTFT against the request rate, one colour per column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = list(trace["rates_rps"])
    rates = [trace["rates_rps"][load] for load in loads]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in COLUMNS:
        by_rate = trace["columns"][name]["by_rate"]
        [line] = ax.plot(rates, [by_rate[load]["mean_s"] for load in loads], marker="o", label=name)
        ax.plot(rates, [by_rate[load]["p99_s"] for load in loads], linestyle="--", color=line.get_color())
    ax.set(xlabel="request rate (requests/s)", ylabel="TTFT (s): mean solid, P99 dashed",
           title="vLLM's OpenAI server, Mooncake trace requests (CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
