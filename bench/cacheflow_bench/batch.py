"""Batch benchmark: a slice of the Mooncake conversation trace replayed on the local cluster, per policy
and batch size, and the simulator's prediction of the same runs and of a cluster-scale deployment.

Real part: `cacheflow` processes on loopback (tiny model, 2 stage workers with one torch thread each,
each pinned to its own core, 2 filesystem storage pods shaped so that Tio/Tcomp = 1 for a stage, one
coordinator per batch size). Each worker is one engine: a compute loop running one batched forward
per step over every request on its stage, and one loader per pod, driven by the batch scheduler.
The cached prefixes are stored once (a warm-up); each run replays the same requests at their (scaled)
arrival times with `save: false`, so every policy meets the same storage. Policies: compute-only (what
vLLM does on a miss, and the engine's strongest recompute: the whole prompt prefilled through the
stages, batched like any prefill, nothing looked up),
load-only, cake (per-request token-wise two pointers, channels in arrival order) and cacheflow; the
other channel rankings (`--rankings`) are replayed at the largest batch. TTFT is the coordinator's
(arrival to first token: prefix lookup + queue + restore + suffix prefill). Each run also records the
workers' compute-loop and channel busy shares (the paper's Fig. 5, measured).

Simulator part: the same requests, batch sizes and link, with the costs `cacheflow profile` measured
on this machine, fitted to the cluster by requests restored alone; it models the engine (batched
steps with the same token budget, prefill-sized compute-only units). Then a cluster of 8 stages and
8 storage channels with batches up to 64 at Tio/Tcomp of 2, 1 and 0.5, replaying more requests (100)
at denser arrivals (x0.01) so that its batches fill up.

`batched_forward_speedup`: one forward over 8 requests' 64-token chunks against 8 single-request
forwards, same model, one torch thread, interleaved repeats (median).

Writes bench/results/batch.{json,md,png}; the JSON's `summary` holds the issue's targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from cacheflow_bench.batch_sim import (
    MODEL,
    N_PODS,
    N_STAGES,
    Calibration,
    batch_bounds,
    calibrate,
    cluster_scale,
    model_shape,
    sim_errors,
)
from cacheflow_bench.common import (
    TRACE,
    add_out_option,
    command_line,
    machine_facts,
    markdown_table,
    results_dir,
    write_json,
)
from cacheflow_common.restore.profile import Profile
from cacheflow_common.sim import ModelShape
from cacheflow_common.sim.config import balanced_link_gbps
from cacheflow_common.sim.replay import ReplayRequest, load_slice, read_records, select_requests
from cacheflow_services.coordinator.launch import LocalCoordinator, launch_coordinator
from cacheflow_services.local_cluster import SECRETS_DIR, ClusterSpec, LocalCluster, start_cluster
from cacheflow_services.replay import ReplayError, replay, ttft_stats, warm_up
from cacheflow_services.worker.launch import LocalWorker

POLICIES = ("compute-only", "load-only", "cake", "cacheflow")
# CacheFlow's other rules (the one it replaced first), replayed at the largest batch
RANKINGS = ("cacheflow-srpt", "cacheflow-alg1", "cacheflow-progress", "cacheflow-hrrn")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(TRACE),
                   help="the Mooncake trace (JSONL, or .jsonl.gz), or a slice of it saved as JSON (default: the "
                        "trace in bench/traces)")
    p.add_argument("--start", type=int, default=3000, help="first trace line considered")
    p.add_argument("--requests", type=int, default=24, help="requests replayed per run")
    p.add_argument("--token-scale", type=int, default=8, help="trace lengths are divided by this")
    p.add_argument("--max-tokens", type=int, default=2048, help="longer (scaled) requests are skipped")
    p.add_argument("--time-scale", type=float, default=0.05, help="trace arrival times are multiplied by this")
    p.add_argument("--cluster-requests", type=int, default=100, help="requests in the cluster-scale simulation")
    p.add_argument("--cluster-time-scale", type=float, default=0.01,
                   help="its arrival times are multiplied by this (denser than the local replay: batches fill up)")
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--batches", default="2,4,8")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--rankings", default=",".join(RANKINGS),
                   help="CacheFlow's other channel rankings, replayed at the largest batch only ('' for none)")
    p.add_argument("--repeats", type=int, default=3, help="runs per batch size and policy (medians reported)")
    add_out_option(p)
    p.add_argument("--quick", action="store_true", help="smoke run: few short requests, batch 2 and 8")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.max_tokens, args.batches, args.cluster_requests, args.repeats = 4, 512, "2,8", 8, 1
    args.batch_sizes = [int(b) for b in args.batches.split(",")]
    args.policy_names = args.policies.split(",")
    args.ranking_names = [r for r in args.rankings.split(",") if r]
    return args


# -- calibration ------------------------------------------------------------------------------------
def profile_machine(workdir: Path, chunk_size: int, max_tokens: int) -> Profile:
    """`cacheflow profile` with one torch thread, as each worker runs."""
    out = workdir / "profile.json"
    subprocess.run([sys.executable, "-m", "cacheflow_services.cli", "profile", "--model", MODEL, "--dtype", "float32",
                    "--threads", "1", "--chunk-size", str(chunk_size), "--max-tokens", str(max_tokens),
                    "--out", str(out)], check=True, capture_output=True)
    return Profile.load(out)


# -- the real cluster ---------------------------------------------------------------------------------
def start(workdir: Path, chunk_size: int, max_batch: int, profile_path: Path, rate_gbps: float) -> LocalCluster:
    spec = ClusterSpec(model=MODEL, stages=N_STAGES, pods=N_PODS, chunk_size=chunk_size, dtype="float32",
                       policy="cake", profile=str(profile_path), rate_gbps=rate_gbps, transport="tcp", port=0,
                       threads_per_stage=1, stage_cpus=stage_cpus(), max_batch=max_batch, directory=str(workdir))
    return start_cluster(spec, workdir)


def stage_cpus() -> list[str]:
    """One core per stage worker when there are enough (a stage is one compute resource, as simulated)."""
    cores = sorted(os.sched_getaffinity(0))
    return [str(c) for c in cores[:N_STAGES]] if len(cores) >= N_STAGES else []


def coordinator_for(cluster: LocalCluster, workdir: Path, batch: int) -> LocalCoordinator:
    pods = [f"pod-{i}=127.0.0.1:{p.data_port}" for i, p in enumerate(cluster.pods)]
    return launch_coordinator(workdir / f"coordinator-b{batch}", stages=[w.url for w in cluster.workers], pods=pods,
                              pod_token_file=workdir / "pod-tokens", token_file=workdir / "api-tokens",
                              secrets=workdir / SECRETS_DIR, model=MODEL,
                              extra=["--max-batch", str(batch), "--max-queue", "1000"])


# -- main ---------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    trace = Path(args.trace)
    records = load_slice(trace) if trace.suffix == ".json" else read_records(trace, start=args.start, scan=3000)
    requests = select_requests(records, count=args.requests, token_scale=args.token_scale,
                               max_tokens=args.max_tokens, time_scale=args.time_scale)
    shape = model_shape()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"{len(requests)} requests, {sum(r.trace.input_length for r in requests)} tokens; profiling ...",
              flush=True)
        profile = profile_machine(work, args.chunk_size, args.max_tokens)
        link = balanced_link_gbps(profile.costs, shape, n_stages=N_STAGES, n_channels=N_PODS, tokens=1024)
        print(f"link {link:.4f} Gbit/s per pod (Tio/Tcomp = 1); starting the cluster ...", flush=True)
        runs, calibration = real_runs(work, args, requests, link, profile, shape)
    errors = sim_errors(profile, shape, requests, runs, link, args.chunk_size, calibration)
    print("the batch bound of each batch size ...", flush=True)
    bounds = batch_bounds(profile, shape, requests, runs, link, args.chunk_size, calibration)
    dense = select_requests(records, count=args.cluster_requests, token_scale=args.token_scale,
                            max_tokens=args.max_tokens, time_scale=args.cluster_time_scale)
    scale = cluster_scale(profile, shape, dense, args.policy_names, args.chunk_size)
    print("batched forward: one step over 8 requests vs 8 single-request steps ...", flush=True)
    speedup = batched_forward_speedup()
    report(args, requests, link, runs, errors, scale, calibration, speedup, bounds)
    return 0


def real_runs(work: Path, args: argparse.Namespace, requests: list[ReplayRequest], link: float, profile: Profile,
              shape: ModelShape) -> tuple[list[dict[str, Any]], Calibration]:
    cluster = start(work, args.chunk_size, max(args.batch_sizes), work / "profile.json", link)
    runs = []
    try:
        coordinators = {b: coordinator_for(cluster, work, b) for b in args.batch_sizes}
        try:
            first = coordinators[args.batch_sizes[0]]
            print("warm-up: storing the cached prefixes ...", flush=True)
            warm_up(first.url, cluster.token, MODEL, requests, cluster.workers)
            calibration = calibrate(first.url, cluster.token, requests, profile, shape, link, args.chunk_size)
            print(f"calibration (measured / profiled, one request alone): {calibration}", flush=True)
            workers = cluster.workers
            for repeat in range(args.repeats):  # policies interleaved: a slow spell of the machine hits them all
                for batch, coordinator in coordinators.items():
                    rankings = args.ranking_names if batch == max(args.batch_sizes) else []
                    for policy in [*args.policy_names, *rankings]:
                        before = busy_totals(workers)
                        per_request, failure = replay_retried(coordinator.url, cluster.token, requests, policy)
                        stats = ttft_stats([r["ttft_s"] for r in per_request])
                        runs.append({"batch": batch, "policy": policy, "repeat": repeat, **stats,
                                     **busy_shares(before, busy_totals(workers)),
                                     "failed_first_try": failure, "requests": per_request})
                        print(f"  run {repeat + 1}, batch {batch} {policy:>12}: TTFT mean {stats['mean_s']:.3f} s, "
                              f"p99 {stats['p99_s']:.3f} s", flush=True)
        finally:
            for c in coordinators.values():
                c.stop()
    finally:
        cluster.stop()
    return runs, calibration


def busy_totals(workers: list[LocalWorker]) -> list[dict[str, Any]]:
    """Each worker's busy seconds since it started: its compute loop's and each of its channels'."""
    return [httpx.get(f"{w.url}/v1/info", headers=w.granted_headers("info"), timeout=30).json()["busy"]
            for w in workers]


def busy_shares(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, float]:
    """The share of a run's wall time the stages' compute loops, and their channels, were busy (mean over
    stages; channels: mean over a stage's channels)."""
    compute, io = [], []
    for b, a in zip(before, after, strict=True):
        wall = a["uptime_s"] - b["uptime_s"]
        compute.append((a["compute_s"] - b["compute_s"]) / wall)
        io.append(statistics.mean(ac - bc for ac, bc in zip(a["channels_s"], b["channels_s"], strict=True)) / wall)
    return {"compute_busy_share": statistics.mean(compute), "io_busy_share": statistics.mean(io)}


def batched_forward_speedup(requests: int = 8, chunk: int = 64, context: int = 512, repeats: int = 7) -> float:
    """Tokens per second of one forward over `requests` requests' `chunk`-token chunks (each after `context`
    tokens of KV) over that of the same chunks one request per forward; one torch thread, as a worker."""
    import time

    import torch

    from cacheflow_common.model.sources import load_model
    from cacheflow_common.model.transformer import Span

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = load_model(MODEL, dtype=torch.float32)
        kvs = [model.new_kv(model.layers, context + chunk) for _ in range(requests)]
        rows = [model.embed(torch.randint(0, model.config.vocab_size, (chunk,))) for _ in kvs]  # [chunk, hidden]

        def batched() -> None:
            model.forward_layers(torch.cat(rows), model.layers, [Span(kv, context, chunk) for kv in kvs])

        def one_by_one() -> None:
            for x, kv in zip(rows, kvs, strict=True):
                model.forward_layers(x, model.layers, [Span(kv, context, chunk)])

        times: dict[str, list[float]] = {"batched": [], "single": []}
        for i in range(repeats + 1):  # interleaved; the first round warms up and is dropped
            for name, run in (("batched", batched), ("single", one_by_one)):
                began = time.perf_counter()
                run()
                if i:
                    times[name].append(time.perf_counter() - began)
        return statistics.median(times["single"]) / statistics.median(times["batched"])
    finally:
        torch.set_num_threads(threads)


def replay_retried(url: str, token: str, requests: list[ReplayRequest], policy: str
                   ) -> tuple[list[dict[str, Any]], str]:
    """A replay, run once more if a request failed (the failure is returned and recorded, not hidden)."""
    try:
        return replay(url, token, MODEL, requests, policy), ""
    except ReplayError as exc:
        print(f"  a request failed, the run is repeated: {exc}", flush=True)
        return replay(url, token, MODEL, requests, policy), str(exc)


def report(args: argparse.Namespace, requests: list[ReplayRequest], link: float, runs: list[dict[str, Any]],
           errors: list[dict[str, Any]], scale: list[dict[str, Any]], calibration: Calibration,
           speedup: float, bounds: list[dict[str, Any]]) -> None:
    from cacheflow_bench.batch_report import summary_of, write_markdown, write_plot

    out = results_dir(args)
    summary = (summary_of(runs, errors) | bound_keys(bounds) | {"batched_forward_speedup": speedup}
               | sweep_keys(out / "batch.json"))
    body = {"summary": summary, "machine": machine_facts(), "command": command_line(), "quick": args.quick,
            "link_gbps_per_pod": link,
            "link": {"emulated": True, "gbps_per_pod": link,
                     "chosen": "each pod's token bucket at the rate at which a stage's loads of a 1,024-token prefix "
                               "take as long as its compute (the profile's costs): Tio/Tcomp = 1"},
            "cluster_requests": args.cluster_requests, "cluster_time_scale": args.cluster_time_scale,
            "calibration": asdict(calibration),
            "requests": [{"id": r.trace.request_id, "arrival_s": r.trace.arrival_s, "tokens": r.trace.input_length,
                          "cached": r.trace.cached_tokens} for r in requests],
            "runs": runs, "sim_validation": errors, "bounds": bounds, "cluster_scale": scale}
    write_json(out / "batch.json", body)
    write_markdown(out / "batch.md", body, markdown_table)
    write_plot(out / "batch.png", runs, scale)
    print(f"summary: {summary}")


def bound_keys(bounds: list[dict[str, Any]]) -> dict[str, Any]:
    """CacheFlow's and Cake's mean and slowest TTFT over the batch bound at the largest batch."""
    if not bounds:
        return {}
    largest = max(bounds, key=lambda b: b["batch"])["policies"]
    return {f"{key}_over_bound_{name}_b8": largest[policy][f"{key}_over_bound"]
            for policy, name in (("cacheflow", "cacheflow"), ("cake", "cake")) if policy in largest
            for key in ("mean", "max")}


def sweep_keys(path: Path) -> dict[str, Any]:
    """The trace sweep's keys already in `path` (`cacheflow bench sweep` writes them there): kept."""
    if not path.exists():
        return {}
    return {k: v for k, v in json.loads(path.read_text()).get("summary", {}).items() if k.startswith("sweep_")}


if __name__ == "__main__":
    sys.exit(main())
