"""The trace sweep on the local cluster: the batch benchmark's cluster (tiny model, 2 stage workers on one
core each, 2 storage pods behind links balanced by a 1,024-token restore, chunk 64, batch 8) replays every
window at every load level, each policy `rounds` times, interleaved with their order rotated each round
(as `cacheflow demo` does), after one warm-up replay. A window's prefixes are stored once, before its
first replay. Per window and level, each request's TTFT is its mean over the rounds; the window's mean,
P50, P99 and slowest TTFT come from those.

The yardsticks come from the same run: the simulator is calibrated to the cluster from requests restored
alone (`batch_sim.calibrate`, as the batch benchmark does), and on that calibrated cost model it
predicts each policy's mean TTFT per window and level (its error is reported) and the batch bound is
solved (`cacheflow_common.sched.bound`).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from cacheflow_bench.batch import coordinator_for, profile_machine, replay_retried, start
from cacheflow_bench.batch_sim import (
    N_PODS,
    N_STAGES,
    Calibration,
    calibrate,
    model_shape,
    sim_config,
    simulated,
)
from cacheflow_bench.sweep import at_level
from cacheflow_common.restore.profile import Profile
from cacheflow_common.sim import ModelShape
from cacheflow_common.sim.config import balanced_link_gbps
from cacheflow_common.sim.replay import ReplayRequest
from cacheflow_services.demo.run import round_orders
from cacheflow_services.replay import warm_up

MODEL = "tiny"


def cluster_cells(args: argparse.Namespace, windows: list[list[ReplayRequest]], levels: dict[str, float],
                  policies: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every window at every level on the local cluster: per cell, each policy's per-request TTFTs (mean over
    the rounds) and the simulator's prediction of its mean; and the run's calibration and link."""
    shape = model_shape()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print(f"{len(windows)} windows of {len(windows[0])} requests; profiling ...", flush=True)
        profile = profile_machine(work, args.chunk_size, args.max_tokens)
        link = balanced_link_gbps(profile.costs, shape, n_stages=N_STAGES, n_channels=N_PODS, tokens=1024)
        cluster = start(work, args.chunk_size, args.batch, work / "profile.json", link)
        try:
            coordinator = coordinator_for(cluster, work, args.batch)
            try:
                url, token = coordinator.url, cluster.token
                print("storing the first window's prefixes; calibrating ...", flush=True)
                warm_up(url, token, MODEL, windows[0], cluster.workers)
                calibration = calibrate(url, token, windows[0], profile, shape, link, args.chunk_size)
                print(f"calibration (measured / profiled, one request alone): {calibration}", flush=True)
                replay_retried(url, token, at_level(windows[0], levels["medium"]), policies[-1])  # warm-up
                cells = []
                for w, window in enumerate(windows):
                    if w:
                        warm_up(url, token, MODEL, window, cluster.workers)
                    for level, scale in levels.items():
                        cells.append({"level": level, "window": w,
                                      **_replays(url, token, at_level(window, scale), policies, args.rounds)})
                        print(f"window {w} {level:>8}: " + ", ".join(
                            f"{p} {statistics.fmean(cells[-1][p]['ttft_s']):.3f}" for p in policies), flush=True)
            finally:
                coordinator.stop()
        finally:
            cluster.stop()
    for cell in cells:
        _add_prediction(cell, windows[cell["window"]], levels[cell["level"]], policies, profile, shape, link,
                        args, calibration)
    return cells, {"link_gbps_per_pod": link, "calibration": calibration, "profile": profile, "shape": shape}


def _replays(url: str, token: str, requests: list[ReplayRequest], policies: list[str],
             rounds: int) -> dict[str, Any]:
    """Each policy replayed `rounds` times, interleaved; per policy each request's TTFT (mean over the rounds)
    and what was restored (for the simulator: the first round's lookups)."""
    runs: dict[str, list[list[dict[str, Any]]]] = {p: [] for p in policies}
    failures: list[str] = []
    for order in round_orders(policies, rounds):
        for policy in order:
            per_request, failure = replay_retried(url, token, requests, policy)
            runs[policy].append(per_request)
            failures += [f"{policy}: {failure}"] if failure else []
    out: dict[str, Any] = {"failed_first_try": failures}
    for policy, mine in runs.items():
        out[policy] = {"ttft_s": [statistics.fmean(run[i]["ttft_s"] for run in mine) for i in range(len(requests))],
                       "measured": mine[0]}
    return out


def _add_prediction(cell: dict[str, Any], window: list[ReplayRequest], scale: float, policies: list[str],
                    profile: Profile, shape: ModelShape, link: float, args: argparse.Namespace,
                    calibration: Calibration) -> None:
    """The calibrated simulator's TTFTs of each policy in `cell`, with the prefixes and lookups the real run had."""
    requests = at_level(window, scale)
    for policy in policies:
        config = sim_config(profile, shape, policy=policy, batch=args.batch, n_stages=N_STAGES, n_channels=N_PODS,
                            link_gbps=link, chunk_size=args.chunk_size, calibration=calibration)
        cell[policy]["sim_ttft_s"] = simulated(config, requests, cell[policy].pop("measured"), "ttft_s")
