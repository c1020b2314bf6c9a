"""`cacheflow demo`: what CacheFlow does for time-to-first-token, on this machine, in a few minutes.

It profiles the model here once (a quick `cacheflow profile`, cached), starts the local cluster
(`cacheflow up`'s pieces: storage pods, one worker per stage, a coordinator) with each pod's link
shaped so that loading a stage's KV takes as long as recomputing it (Tio/Tcomp = 1), stores the
cached prefixes of a slice of the Mooncake conversation trace shipped with the package, then replays
the slice once per restore policy and reports TTFT per policy (table, CDF plot, Markdown report).
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from cacheflow_common.model.sources import model_config
from cacheflow_common.restore.profile import Profile
from cacheflow_common.sim import ModelShape
from cacheflow_common.sim.config import balanced_link_gbps
from cacheflow_common.sim.replay import ReplayRequest, load_slice, select_requests
from cacheflow_services.demo.report import print_table, write_report
from cacheflow_services.local_cluster import ClusterSpec, LocalCluster, start_cluster
from cacheflow_services.replay import replay, ttft_stats, warm_up

POLICIES = ("compute-only", "load-only", "cake", "cacheflow")
SLICE = Path(__file__).with_name("mooncake_slice.json")
TOLERANCE = 1.25  # a lone restore's Tio/Tcomp within [1/1.25, 1.25] counts as balanced


def choose_requests(args: argparse.Namespace) -> list[ReplayRequest]:
    """The shipped slice, scaled to this CPU; only requests with at least two chunks cached."""
    requests = select_requests(load_slice(SLICE), count=args.requests, token_scale=args.token_scale,
                               max_tokens=args.max_tokens, time_scale=args.time_scale, min_cached=2 * args.chunk_size)
    if not requests:
        raise SystemExit("cacheflow demo: no request of the slice fits these settings")
    return requests


def ensure_profile(args: argparse.Namespace, cache_dir: Path) -> Path:
    """A quick profile of the model with one torch thread (as each worker runs), made once per setting."""
    path = cache_dir / f"profile-demo-{args.model}-c{args.chunk_size}.json"
    if not path.exists():
        print(f"profiling {args.model} on this machine (once; about a minute) ...", flush=True)
        subprocess.run([sys.executable, "-m", "cacheflow_services.cli", "profile", "--quick", "--model", args.model,
                        "--threads", "1", "--chunk-size", str(args.chunk_size), "--max-tokens",
                        str(args.max_tokens), "--out", str(path)], check=True, stdout=subprocess.DEVNULL)
    return path


def balanced_link(args: argparse.Namespace, profile: Profile, requests: list[ReplayRequest]) -> float:
    """Gbit/s per pod at which a stage's loads take as long as its compute, for the median request."""
    shape = ModelShape.of(model_config(args.model), profile.dtype)
    median = sorted(r.trace.cached_tokens for r in requests)[len(requests) // 2]
    return balanced_link_gbps(profile.costs, shape, n_stages=args.stages, n_channels=args.pods, tokens=median)


def measured_io_over_compute(cluster: LocalCluster, model: str, requests: list[ReplayRequest]) -> float:
    """Restore the median request alone, load-only then compute-only: Tio / Tcomp as this machine runs it."""
    probe = sorted(requests, key=lambda r: r.trace.cached_tokens)[len(requests) // 2]
    probe = replace(probe, trace=replace(probe.trace, arrival_s=0.0))
    url, token = cluster.coordinator.url, cluster.token
    load, compute = (replay(url, token, model, [probe], policy)[0]["restore_s"]
                     for policy in ("load-only", "compute-only"))
    return load / compute


def replay_policies(cluster: LocalCluster, model: str, requests: list[ReplayRequest], policies: list[str]
                    ) -> list[dict[str, Any]]:
    runs = []
    with tqdm(total=len(requests) * len(policies), unit="request") as bar:
        for policy in policies:
            bar.set_description(f"replaying: {policy}")
            per_request = replay(cluster.coordinator.url, cluster.token, model, requests, policy,
                                 on_done=lambda: bar.update(1))
            runs.append({"policy": policy, **ttft_stats([r["ttft_s"] for r in per_request]), "requests": per_request})
    return runs


def balanced_cluster(spec: ClusterSpec, workdir: Path, requests: list[ReplayRequest]
                     ) -> tuple[LocalCluster, ClusterSpec]:
    """Start the cluster, store the cached prefixes, and, if a lone restore's Tio/Tcomp is off 1 by more
    than TOLERANCE (the quick profile misjudges compute under the cluster's own load), restart the
    cluster once with its links rescaled (the stored chunks stay)."""
    cluster = start_cluster(spec, workdir)
    try:
        with tqdm(total=len(requests), desc="storing prefixes", unit="request") as bar:
            warm_up(cluster.coordinator.url, cluster.token, spec.model, requests,
                    [w.url for w in cluster.workers], on_done=lambda: bar.update(1))
        ratio = measured_io_over_compute(cluster, spec.model, requests)
    except BaseException:
        cluster.stop()
        raise
    if abs(math.log(ratio)) <= math.log(TOLERANCE):
        return cluster, spec
    cluster.stop()
    spec = replace(spec, rate_gbps=spec.rate_gbps * ratio)
    print(f"a lone restore measured Tio/Tcomp = {ratio:.2f}: restarting with links of "
          f"{spec.rate_gbps * 1000:.1f} Mbit/s", flush=True)
    return start_cluster(spec, workdir), spec


def run(args: argparse.Namespace, cache_dir: Path) -> int:
    requests = choose_requests(args)
    profile_path = ensure_profile(args, cache_dir)
    link = balanced_link(args, Profile.load(profile_path), requests)
    workdir = cache_dir / "demo-cluster"
    shutil.rmtree(workdir, ignore_errors=True)  # every demo starts from empty storage
    spec = ClusterSpec(model=args.model, stages=args.stages, pods=args.pods, chunk_size=args.chunk_size,
                       profile=str(profile_path), rate_gbps=link, port=0, threads_per_stage=1, directory=str(workdir))
    print(f"{len(requests)} requests of the Mooncake conversation trace ({sum(r.trace.input_length for r in requests)} "
          f"tokens, {sum(r.trace.cached_tokens for r in requests)} of them cached); starting {args.pods} storage "
          f"pods (links of {link * 1000:.1f} Mbit/s: Tio/Tcomp = 1 by the profile), {args.stages} stage workers "
          f"and a coordinator for {args.model} ...", flush=True)
    cluster, spec = balanced_cluster(spec, workdir, requests)
    try:
        runs = replay_policies(cluster, args.model, requests, args.policies.split(","))
    finally:
        cluster.stop()
    print_table(runs)
    written = write_report(Path(args.out), runs, requests=requests, spec=spec)
    print(f"report: {written['md']}\nplot:   {written['png']}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="replay a trace slice on a local cluster per restore policy; TTFT report")
    demo.add_argument("--model", default="smollm2", help="tiny | smollm2 | a model directory")
    demo.add_argument("--requests", type=int, default=8, help="trace requests replayed per policy")
    demo.add_argument("--token-scale", type=int, default=8, help="trace lengths are divided by this")
    demo.add_argument("--max-tokens", type=int, default=1536, help="longer (scaled) requests are skipped")
    demo.add_argument("--time-scale", type=float, default=0.05, help="trace arrival times are multiplied by this")
    demo.add_argument("--chunk-size", type=int, default=128)
    demo.add_argument("--stages", type=int, default=2)
    demo.add_argument("--pods", type=int, default=2)
    demo.add_argument("--policies", default=",".join(POLICIES))
    demo.add_argument("--out", default="cacheflow-demo", help="where the report and plot go")
