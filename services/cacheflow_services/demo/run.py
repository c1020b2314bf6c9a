"""`cacheflow demo`: what CacheFlow does for time-to-first-token, on this machine, in a few minutes.

It profiles the model here once (a quick `cacheflow profile`, cached), starts the local cluster
(`cacheflow up`'s pieces: storage pods, one worker per stage, a coordinator) with each pod's link
shaped so that loading a stage's KV takes as long as recomputing it (Tio/Tcomp = 1), stores the
cached prefixes of a slice of the Mooncake conversation trace shipped with the package, replays the
slice once as a warm-up (not reported), then replays it per restore policy, policies interleaved
(their order rotated each round), and reports TTFT per policy (table, CDF plot, Markdown report).
A step that fails says so in one line, with where the logs are.

The link rate: the profile's balanced rate for the median request, checked on the running cluster by
restoring that request alone, load-only then compute-only: one untimed pair first (a restore path's
first use pays one-time costs), then the median of PROBES timed pairs. A Tio/Tcomp off 1 by more than
TOLERANCE restarts the cluster with its links rescaled. `--link-gbps` gives the rate instead (nothing
measured): the demo prints the rate it used, so a rerun can take the same operating point.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import statistics
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from cacheflow_common.errors import CacheFlowError
from cacheflow_common.model.sources import model_config
from cacheflow_common.restore.profile import Profile
from cacheflow_common.sched.policies import POLICIES as POLICY_NAMES
from cacheflow_common.sim import ModelShape
from cacheflow_common.sim.config import balanced_link_gbps
from cacheflow_common.sim.replay import ReplayRequest, load_slice, read_records, select_requests
from cacheflow_services.demo.report import LinkChoice, print_key, print_table, print_verdict, write_report
from cacheflow_services.local_cluster import LOCK_FILE, ClusterSpec, LocalCluster, hold_workdir, start_cluster
from cacheflow_services.local_process import Stopped, exit_on_signals, print_ready, reporting_ready
from cacheflow_services.profiling import ensure_quick_profile
from cacheflow_services.replay import Replayer, ReplayError, replay, restore_alone, warm_up

POLICIES = ("compute-only", "load-only", "cake", "cacheflow")
SLICE = Path(__file__).with_name("mooncake_slice.json")
TOLERANCE = 1.25  # a lone restore's Tio/Tcomp within [1/1.25, 1.25] counts as balanced
PROBES = 3  # timed lone-restore pairs (load-only, compute-only) whose median Tio/Tcomp checks the balance
THREADS = 1  # torch threads per stage worker (and for the profile)


class DemoError(CacheFlowError):
    """A step of the demo failed; the message says which, and where the logs are."""


@contextlib.contextmanager
def step(what: str, logs: Path) -> Iterator[None]:
    """Turn a failed request of this step into one line naming the step and the cluster's logs."""
    try:
        yield
    except (ReplayError, httpx.HTTPError) as exc:
        raise DemoError(f"{what} failed: {' '.join(str(exc).split())} (the cluster's logs: {logs})") from None


def choose_requests(args: argparse.Namespace) -> list[ReplayRequest]:
    """The shipped slice (or a window of `--trace` from line `--start`), scaled to this CPU; only requests with
    at least two chunks cached."""
    records = read_records(Path(args.trace), start=args.start, scan=2000) if args.trace else load_slice(SLICE)
    requests = select_requests(records, count=args.requests, token_scale=args.token_scale,
                               max_tokens=args.max_tokens, time_scale=args.time_scale, min_cached=2 * args.chunk_size)
    if not requests:
        raise SystemExit("cacheflow demo: no request of the slice fits these settings")
    return requests


def ensure_profile(args: argparse.Namespace, cache_dir: Path) -> Path:
    """A quick profile of the model with the workers' torch threads, made once per setting."""
    return ensure_quick_profile(cache_dir, args.model, dtype="auto", chunk_size=args.chunk_size,
                                max_tokens=args.max_tokens, threads=THREADS)


def balanced_link(args: argparse.Namespace, profile: Profile, requests: list[ReplayRequest]) -> float:
    """Gbit/s per pod at which a stage's loads take as long as its compute, for the median request."""
    shape = ModelShape.of(model_config(args.model), profile.dtype)
    median = sorted(r.trace.cached_tokens for r in requests)[len(requests) // 2]
    return balanced_link_gbps(profile.costs, shape, n_stages=args.stages, n_channels=args.pods, tokens=median)


def measured_io_over_compute(cluster: LocalCluster, requests: list[ReplayRequest], probes: int = PROBES) -> float:
    """Restore the median request alone, load-only then compute-only, once untimed and then `probes` times:
    the median load time over the median compute time, Tio / Tcomp as this machine runs it."""
    probe = sorted(requests, key=lambda r: r.trace.cached_tokens)[len(requests) // 2]
    probe = replace(probe, trace=replace(probe.trace, arrival_s=0.0))
    times: dict[str, list[float]] = {"load-only": [], "compute-only": []}
    for _ in range(probes + 1):
        for policy, took in times.items():
            took.append(restore_alone(cluster.coordinator.url, cluster.token, probe, policy))
    return statistics.median(times["load-only"][1:]) / statistics.median(times["compute-only"][1:])


def round_orders(policies: list[str], rounds: int) -> list[list[str]]:
    """The policies' order in each round, rotated by one each round (none always goes first)."""
    return [policies[r % len(policies):] + policies[: r % len(policies)] for r in range(rounds)]


def replay_policies(cluster: LocalCluster, model: str, requests: list[ReplayRequest], policies: list[str],
                    rounds: int, send: Replayer = replay) -> list[dict[str, Any]]:
    """One warm-up replay (not reported), then `rounds` replays per policy, interleaved; per policy its
    TTFT statistics over every round and the per-request results (with their round)."""
    url, token = cluster.coordinator.url, cluster.token
    print(f"warm-up replay ({policies[-1]}; not reported) ...", flush=True)
    send(url, token, model, requests, policies[-1])
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    with tqdm(total=len(requests) * len(policies) * rounds, unit="request") as bar:
        for number, order in enumerate(round_orders(policies, rounds)):
            for policy in order:
                bar.set_description(f"round {number + 1}/{rounds}: {policy}")
                per_request = send(url, token, model, requests, policy, on_done=lambda: bar.update(1))
                results[policy] += [{**r, "round": number} for r in per_request]
    return [{"policy": p, **ttft_summary([r["ttft_s"] for r in rs]), "round_means_s": round_means(rs, rounds),
             "requests": rs} for p, rs in results.items()]


def round_means(results: list[dict[str, Any]], rounds: int) -> list[float]:
    """Each round's mean TTFT, in round order: their spread says how far one round is from the next."""
    return [statistics.fmean(r["ttft_s"] for r in results if r["round"] == number) for number in range(rounds)]


def ttft_summary(ttfts: list[float]) -> dict[str, float]:
    """Mean, median and maximum: over a few requests a "P99" is just the maximum, so it is called that."""
    return {"mean_s": statistics.fmean(ttfts), "p50_s": statistics.median(ttfts), "max_s": max(ttfts)}


def check_args(args: argparse.Namespace) -> None:
    """Bad settings fail here, in one line, before anything is measured or started."""
    if unknown := [p for p in args.policies.split(",") if p not in POLICY_NAMES]:
        raise DemoError(f"unknown policies {unknown}; choose from {', '.join(POLICY_NAMES)}")
    if args.rounds < 1 or args.requests < 1:
        raise DemoError("--rounds and --requests must be at least 1")
    if args.link_gbps is not None and not args.link_gbps > 0:
        raise DemoError(f"--link-gbps must be a rate above 0 Gbit/s, not {args.link_gbps}")


def stored_cluster(spec: ClusterSpec, workdir: Path, requests: list[ReplayRequest]) -> LocalCluster:
    """Start the cluster and store the requests' cached prefixes (stopped again if that fails)."""
    with reporting_ready(print_ready):
        cluster = start_cluster(spec, workdir)
    try:
        with step("storing the cached prefixes", workdir), \
                tqdm(total=len(requests), desc="storing prefixes", unit="request") as bar:
            warm_up(cluster.coordinator.url, cluster.token, spec.model, requests,
                    cluster.workers, on_done=lambda: bar.update(1))
    except BaseException:
        cluster.stop()
        raise
    return cluster


def balanced_cluster(spec: ClusterSpec, workdir: Path, requests: list[ReplayRequest]
                     ) -> tuple[LocalCluster, ClusterSpec, LinkChoice]:
    """Start the cluster at the profile's balanced rate, store the cached prefixes, and, if a lone
    restore's Tio/Tcomp is off 1 by more than TOLERANCE (the quick profile misjudges compute under the
    cluster's own load), restart the cluster once with its links rescaled (the stored chunks stay)."""
    cluster = stored_cluster(spec, workdir, requests)
    try:
        with step("measuring a lone restore's Tio/Tcomp", workdir):
            print(f"checking the balance: the median request restored alone, load-only then compute-only, "
                  f"{PROBES + 1} times each ...", flush=True)
            ratio = measured_io_over_compute(cluster, requests)
    except BaseException:
        cluster.stop()
        raise
    profile_gbps = spec.rate_gbps
    checked = f"a lone restore measured Tio/Tcomp = {ratio:.2f} (median of {PROBES}, after one untimed)"
    if abs(math.log(ratio)) <= math.log(TOLERANCE):
        how = f"the profile's balanced rate (Tio/Tcomp = 1); on the cluster {checked}, within {TOLERANCE}x: kept"
        return cluster, spec, LinkChoice(profile_gbps, how, profile_gbps, ratio)
    cluster.stop()
    spec = replace(spec, rate_gbps=profile_gbps * ratio)
    how = f"the profile's balanced rate ({profile_gbps * 1000:.1f} Mbit/s) rescaled: on the cluster {checked}"
    print(f"{checked}: restarting with links of {spec.rate_gbps * 1000:.1f} Mbit/s", flush=True)
    with reporting_ready(print_ready):
        return start_cluster(spec, workdir), spec, LinkChoice(spec.rate_gbps, how, profile_gbps, ratio)


def demo_cluster(args: argparse.Namespace, spec: ClusterSpec, workdir: Path, requests: list[ReplayRequest]
                 ) -> tuple[LocalCluster, ClusterSpec, LinkChoice]:
    """The cluster with the requests' prefixes stored, at the rate `--link-gbps` gives, or balanced here."""
    if args.link_gbps is None:
        return balanced_cluster(spec, workdir, requests)
    return stored_cluster(spec, workdir, requests), spec, LinkChoice(spec.rate_gbps, "given with --link-gbps")


def run(args: argparse.Namespace, cache_dir: Path) -> int:
    """The demo; SIGTERM, SIGINT (Ctrl-C) or SIGHUP stop the cluster it started, wherever it is."""
    with exit_on_signals():
        try:
            return _run(args, cache_dir)
        except Stopped as stopped:
            print(f"cacheflow demo: stopped by {stopped}", file=sys.stderr, flush=True)
            return 128 + stopped.signum


def _run(args: argparse.Namespace, cache_dir: Path) -> int:
    check_args(args)
    requests = choose_requests(args)
    profile_path = ensure_profile(args, cache_dir)
    link = args.link_gbps or balanced_link(args, Profile.load(profile_path), requests)
    workdir = cache_dir / "demo-cluster"
    with hold_workdir(workdir):  # one demo at a time: another would empty this one's storage
        return _demo(args, workdir, requests, profile_path, link)


def _demo(args: argparse.Namespace, workdir: Path, requests: list[ReplayRequest], profile_path: Path,
          link: float) -> int:
    for entry in workdir.iterdir():  # every demo starts from empty storage (the lock file stays)
        if entry.name != LOCK_FILE:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    spec = ClusterSpec(model=args.model, stages=args.stages, pods=args.pods, chunk_size=args.chunk_size,
                       profile=str(profile_path), rate_gbps=link, port=0, threads_per_stage=THREADS,
                       directory=str(workdir))
    print(f"{len(requests)} requests of the Mooncake conversation trace ({sum(r.trace.input_length for r in requests)} "
          f"tokens, {sum(r.trace.cached_tokens for r in requests)} of them cached); starting {args.pods} storage "
          f"pods (links of {link * 1000:.1f} Mbit/s: "
          f"{'given with --link-gbps' if args.link_gbps else 'Tio/Tcomp = 1 by the profile'}), {args.stages} stage "
          f"workers and a coordinator for {args.model} ...", flush=True)
    cluster, spec, chosen = demo_cluster(args, spec, workdir, requests)
    print(f"{chosen.said()}; `--link-gbps {chosen.gbps:.6g}` runs at this rate again", flush=True)
    try:
        with step("replaying the trace", workdir):
            runs = replay_policies(cluster, args.model, requests, args.policies.split(","), args.rounds)
    finally:
        cluster.stop()
    print_table(runs)
    print_verdict(runs)
    print_key(runs)
    written = write_report(Path(args.out), runs, requests=requests, spec=spec, link=chosen)
    print(f"report: {written['md']}\nplot:   {written['png']}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="replay a trace slice on a local cluster per restore policy; TTFT report")
    demo.add_argument("--model", default="smollm2", help="tiny | smollm2 | a model directory")
    demo.add_argument("--requests", type=int, default=8, help="trace requests replayed per policy and round")
    demo.add_argument("--trace", default="", help="a Mooncake trace (JSONL, or .jsonl.gz) to take the requests "
                      "from instead of the shipped slice, from line --start")
    demo.add_argument("--start", type=int, default=0, help="with --trace: the first trace line considered")
    demo.add_argument("--rounds", type=int, default=2,
                      help="replays per policy, interleaved (the order rotated each round), after one warm-up")
    demo.add_argument("--token-scale", type=int, default=8, help="trace lengths are divided by this")
    demo.add_argument("--max-tokens", type=int, default=1536, help="longer (scaled) requests are skipped")
    demo.add_argument("--time-scale", type=float, default=0.05, help="trace arrival times are multiplied by this")
    demo.add_argument("--chunk-size", type=int, default=128)
    demo.add_argument("--stages", type=int, default=2)
    demo.add_argument("--pods", type=int, default=2)
    demo.add_argument("--policies", default=",".join(POLICIES))
    demo.add_argument("--link-gbps", type=float, default=None,
                      help="each storage pod's link rate in Gbit/s (default: balanced for a lone restore, measured "
                           "here; the demo prints the rate it used, for a rerun at the same operating point)")
    demo.add_argument("--out", default="cacheflow-demo", help="where the report and plot go")
