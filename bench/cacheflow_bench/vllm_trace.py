"""The vLLM bench's trace mode: a slice of the Mooncake conversation trace (the batch bench's: lengths /8,
at most 2,048 tokens, arrival times x0.05) replayed through vLLM's OpenAI server with the connector.

Each column is its own server (`vllm.entrypoints.openai.api_server`, prefix caching off): vLLM's own
recompute, and the connector with load-only, Cake and CacheFlow. Every request's cached prefix is
stored once first (a saving server over an unshaped pod); then the pod's link is emulated at the rate
that makes loading the median request's cached prefix take as long as vLLM recomputing it (Tio/Tcomp =
1, from the single-request rows). A warm-up request, then the requests are sent at their arrival times,
each with max_tokens=1: its TTFT is the client's time from sending to the answer.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from cacheflow_bench.common import TRACE
from cacheflow_common.sim import percentile
from cacheflow_common.sim.replay import ReplayRequest, read_records, select_requests

if TYPE_CHECKING:
    from cacheflow_bench.vllm import Bench

COLUMNS = ("recompute", "load-only", "cake", "cacheflow")  # recompute: no connector; else the connector's policy
START_S = 300.0  # longest wait for a server to answer /health
TIMEOUT_S = 600.0


def trace_requests(count: int) -> list[ReplayRequest]:
    records = read_records(TRACE, start=3000, scan=3000)
    return select_requests(records, count=count, token_scale=8, max_tokens=2048, time_scale=0.05)


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


def replay(server: Server, requests: list[ReplayRequest]) -> list[tuple[float, int]]:
    """Each request sent at its arrival time; its TTFT and next token, in the requests' order."""
    began = time.monotonic()

    def send(r: ReplayRequest) -> tuple[float, int]:
        time.sleep(max(0.0, began + r.trace.arrival_s - time.monotonic()))
        return server.complete(r.token_ids)

    with ThreadPoolExecutor(max_workers=max(1, len(requests))) as senders:
        return list(senders.map(send, requests))


def run_trace(bench: Bench, requests: list[ReplayRequest], tcomp: dict[int, float],
              kv_bytes_of: Any) -> dict[str, Any]:
    """Every column's TTFTs over the replayed requests; `tcomp`: vLLM's recompute time by prefix length."""
    bench.start_pod()
    with Server(bench, "trace-save", bench.connector()) as saver:
        for r in requests:
            saver.complete(r.token_ids[: r.trace.cached_tokens + 1])
    median_cached = int(statistics.median(r.trace.cached_tokens for r in requests))
    lengths = sorted(tcomp)
    t_med = float(np.interp(median_cached, lengths, [tcomp[n] for n in lengths]))
    rate = kv_bytes_of(median_cached) * 8 / t_med / 1e9
    bench.start_pod(rate)
    columns: dict[str, Any] = {}
    for name in COLUMNS[1:] + COLUMNS[:1]:  # recompute last: the saving server ran first
        connector = None if name == "recompute" else bench.connector(
            policy=name, save=False, profile=str(bench.profile), link_gbps=rate)
        with Server(bench, f"trace-{name}", connector) as server:
            server.complete(bench.warm)
            outcomes = replay(server, requests)
        ttfts = [t for t, _ in outcomes]
        columns[name] = {"ttft_s": ttfts, "mean_s": statistics.fmean(ttfts), "p99_s": percentile(sorted(ttfts), 99),
                         "next_tokens": [tok for _, tok in outcomes]}
    reference = columns["recompute"]["next_tokens"]
    return {"requests": [{"id": r.trace.request_id, "arrival_s": r.trace.arrival_s, "tokens": r.trace.input_length,
                          "cached": r.trace.cached_tokens} for r in requests],
            "rate_gbps": rate, "link_emulated": True, "columns": columns,
            "summary": summarize(columns, reference)}


def summarize(columns: dict[str, Any], reference: list[int]) -> dict[str, Any]:
    mean = {name: c["mean_s"] for name, c in columns.items()}
    best = min(("recompute", "load-only", "cake"), key=lambda name: mean[name])
    return {"vllm_trace_mean_ratio_vs_best_baseline": mean["cacheflow"] / mean[best], "vllm_trace_best_baseline": best,
            "vllm_trace_mean_ratio_vs_cake": mean["cacheflow"] / mean["cake"],
            "vllm_trace_p99_ratio_vs_cake": columns["cacheflow"]["p99_s"] / columns["cake"]["p99_s"],
            "vllm_trace_next_token_matches": all(c["next_tokens"] == reference for c in columns.values()),
            "vllm_trace_mean_s": mean, "vllm_trace_p99_s": {n: c["p99_s"] for n, c in columns.items()}}


def report_lines(trace: dict[str, Any]) -> list[str]:
    s = trace["summary"]
    rows = "\n".join(f"| {name} | {s['vllm_trace_mean_s'][name]:.3f} | {s['vllm_trace_p99_s'][name]:.3f} |"
                     for name in COLUMNS)
    verdict = "" if s["vllm_trace_mean_ratio_vs_cake"] < 1 else " **CacheFlow does not beat Cake here.**"
    return [
        f"## Trace: {len(trace['requests'])} Mooncake requests through vLLM's OpenAI server", "",
        f"Lengths /8 (at most 2,048 tokens), arrival times x0.05; one pod, its link emulated at "
        f"{trace['rate_gbps']:.3f} Gbit/s (Tio/Tcomp = 1 for the median cached prefix). One run per column.", "",
        "| column | mean TTFT (s) | P99 TTFT (s) |", "|---|---|---|", rows, "",
        f"CacheFlow mean / the best baseline's ({s['vllm_trace_best_baseline']}): "
        f"**{s['vllm_trace_mean_ratio_vs_best_baseline']:.3f}**; mean / Cake's "
        f"{s['vllm_trace_mean_ratio_vs_cake']:.3f}; P99 / Cake's {s['vllm_trace_p99_ratio_vs_cake']:.3f}.{verdict} "
        f"Greedy next tokens equal vLLM's own: {s['vllm_trace_next_token_matches']}.", ""]
