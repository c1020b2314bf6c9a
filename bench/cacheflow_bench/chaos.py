"""Chaos benchmark: a trace slice replayed on a supervised local cluster (`cacheflow up`'s processes) while a
storage pod is killed, a stage worker is killed, and a hostile but fair client abuses a pod and the
coordinator; every answer is checked against the same request on the healthy cluster.

    cacheflow bench chaos [--quick]

Setup: the tiny model in float32 (so that a restore's chunking cannot change a greedy token), 2 stage
workers, 2 filesystem pods with shaped links (loads take part in every restore), policy cacheflow,
`save: false` replays of the demo's shipped Mooncake slice, 4 tokens generated per request. Phases,
each a full replay of the slice (bounded; everything on loopback):

1. healthy: the reference answers;
2. pod kill: pod 0 is SIGKILLed while the replay runs; the supervisor starts it again (same port and data);
3. worker kill: stage 1's worker is SIGKILLed while the replay runs; then a probe request every 0.5 s until
   one succeeds (the recovery time); failures are allowed only for requests in flight at the kill;
4. abuse: during a replay, 300 connections to pod 0 trickle a hello byte every 2 s, 8 authenticated ones
   ask for 256 MiB absent reads and announce 256 MiB PUTs that never come, and the coordinator gets
   2 x max_batch requests with an unknown policy and max_batch streams dropped before their first token;
   a legitimate tenant probes pod 0 on fresh connections every 0.2 s (the lockout), and the pods'
   resident memory is sampled (its growth);
5. worker attacks (`worker_attacks.py`): every route of the workers' route table x every credential class
   (none, wrong, the internal token without a grant, another request's grant, an expired grant, a replayed
   grant), the forward ones saving garbage over a stored prefix; 8 MB deliveries to ids that never come;
   then a replay, whose answers must equal the healthy cluster's (a changed one is a poisoned answer);
6. hostile (`hostile.py`): slowloris on the coordinator's public port; tenant `hog` fills its share of every
   worker's KV pool while the trace's tenant replays; requests after idle gaps around the old keep-alive.

Writes bench/results/chaos.{json,md}; the JSON's `summary` holds the issue's keys.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from cacheflow_bench.abuse import LegitProbe, every, hoard_memory, idle_sockets, rss_mb, wasted_slots
from cacheflow_bench.common import add_out_option, command_line, machine_facts, markdown_table, results_dir, write_json
from cacheflow_bench.hostile import HOG, fill_pools, idle_requests, slowloris
from cacheflow_bench.worker_attacks import attack_workers
from cacheflow_common.model.sources import model_config
from cacheflow_common.sim.replay import ReplayRequest, load_slice, select_requests
from cacheflow_services.demo.run import SLICE
from cacheflow_services.local_cluster import ClusterSpec, LocalCluster, start_cluster
from cacheflow_services.local_process import wait_http
from cacheflow_services.profiling import ensure_quick_profile
from cacheflow_services.replay import replay_outcomes, warm_up

MODEL, CHUNK, NEW_TOKENS, MAX_BATCH = "tiny", 64, 4, 8
RECOVERY_DEADLINE_S = 120.0  # the longest the worker-kill probe waits for a served request


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=16, help="trace requests per replay")
    p.add_argument("--time-scale", type=float, default=0.2, help="trace arrival times are multiplied by this")
    p.add_argument("--rate-gbps", type=float, default=0.2, help="each pod's shaped link")
    p.add_argument("--kill-after-s", type=float, default=0.5, help="when in a replay the pod or worker is killed")
    add_out_option(p)
    p.add_argument("--quick", action="store_true", help="smoke run: 6 requests")
    args = p.parse_args(argv)
    if args.quick:
        args.requests = 6
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    requests = select_requests(load_slice(SLICE), count=args.requests, token_scale=8, max_tokens=1024,
                               time_scale=args.time_scale, min_cached=2 * CHUNK)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        profile = ensure_quick_profile(work, MODEL, dtype="float32", chunk_size=CHUNK, max_tokens=1024, threads=1)
        spec = ClusterSpec(model=MODEL, stages=2, pods=2, chunk_size=CHUNK, dtype="float32", policy="cacheflow",
                           profile=str(profile), rate_gbps=args.rate_gbps, transport="tcp", port=0,
                           threads_per_stage=1, max_batch=MAX_BATCH, directory=str(work / "cluster"),
                           other_tenants=[HOG])
        cluster = start_cluster(spec, work / "cluster")
        try:
            cluster.supervise()
            phases = run_phases(cluster, requests, args)
        finally:
            cluster.stop()
    report(args, requests, phases)
    return 0


def run_phases(cluster: LocalCluster, requests: list[ReplayRequest], args: argparse.Namespace) -> dict[str, Any]:
    url, token = cluster.coordinator.url, cluster.token
    warm_up(url, token, MODEL, requests, cluster.workers)

    def send() -> list[dict[str, Any]]:
        return replay_outcomes(url, token, MODEL, requests, "cacheflow", max_tokens=NEW_TOKENS)

    print("healthy replay (the reference) ...", flush=True)
    reference = send()
    if failed := [r for r in reference if "error" in r]:
        raise RuntimeError(f"the healthy cluster failed requests: {failed}")
    print("pod kill ...", flush=True)
    pod_kill = replay_with(send, lambda: cluster.pods[0].kill(), args.kill_after_s)
    wait_http(cluster.pods[0].url("/readyz"))  # pod 0 back (its supervisor restarts it)
    print("worker kill ...", flush=True)
    worker_kill = replay_with(send, lambda: cluster.workers[1].kill(), args.kill_after_s)
    recovery_s = served_again_after(worker_kill) or recovered_after(url, token, requests[0],
                                                                   worker_kill["killed_at_mono"])
    print("abuse ...", flush=True)
    abuse = abused_replay(cluster, send)
    print("worker attacks ...", flush=True)
    pod_tokens = {t: tok for t, _, tok in (line.partition(" ") for line in (
        cluster.coordinator.log_path.parent / "pod-tokens").read_text().splitlines())}
    attacks = attack_workers(cluster, requests, model_config(MODEL).hidden_size, pod_tokens)
    for worker in cluster.workers:  # whatever an attack could have queued is stored before the replay reads it
        worker.flush(120)
    attacks["outcomes"] = send()
    print("slowloris, a tenant filling the pools, idle gaps ...", flush=True)
    slow = slowloris(url)
    filled = fill_pools(cluster, pod_tokens, send)
    idle = idle_requests(cluster, {"model": MODEL, "prompt": requests[0].token_ids, "max_tokens": 1, "save": False})
    time.sleep(2.0)  # every answer is out; slots must all be free again
    return {"reference": reference, "pod_kill": pod_kill, "worker_kill": worker_kill | {"recovery_s": recovery_s},
            "abuse": abuse, "worker_attacks": attacks, "slowloris": slow, "fill_pools": filled, "idle": idle,
            "leaked_slots": slots_held(url)}


def replay_with(send: Callable[[], list[dict[str, Any]]], kill: Callable[[], None], after_s: float) -> dict[str, Any]:
    """A replay during which `kill` runs `after_s` into it; the outcomes and when the kill happened."""
    killed: dict[str, float] = {}
    began = time.monotonic()

    def killer() -> None:
        time.sleep(after_s)
        killed["at"], killed["mono"] = time.monotonic() - began, time.monotonic()
        kill()

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    outcomes = send()
    thread.join()
    return {"outcomes": outcomes, "killed_at": killed["at"], "killed_at_mono": killed["mono"]}


def served_again_after(run: dict[str, Any]) -> float:
    """Seconds from the kill to the first answer to a request sent after it (0.0: none was served)."""
    killed = run["killed_at"]
    served = [r["answered_s"] - killed for r in run["outcomes"] if "error" not in r and r["sent_s"] >= killed]
    return min(served, default=0.0)


def recovered_after(url: str, token: str, request: ReplayRequest, killed_mono: float) -> float:
    """Seconds from the kill until a probe request is served (one every 0.5 s)."""
    body = {"model": MODEL, "prompt": request.token_ids, "max_tokens": 1, "save": False}
    while time.monotonic() - killed_mono < RECOVERY_DEADLINE_S:
        with contextlib.suppress(httpx.HTTPError):
            answer = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"},
                                timeout=30)
            if answer.status_code == 200:
                return time.monotonic() - killed_mono
        time.sleep(0.5)
    return float("inf")


def abused_replay(cluster: LocalCluster, send: Callable[[], list[dict[str, Any]]]) -> dict[str, Any]:
    pod = cluster.pods[0]
    pod_token = pod.tokens[cluster.tenant]
    pids = [p.proc.pid for p in cluster.pods if p.proc is not None]
    before = {pid: rss_mb(pid) for pid in pids}
    peak = dict(before)
    with every(0.1, lambda: peak.update({pid: max(peak[pid], rss_mb(pid)) for pid in pids})), \
            LegitProbe(pod.data_port, pod_token) as probe, idle_sockets(pod.data_port, 300), \
            hoard_memory(pod.data_port, pod_token, 8):
        not_refused = wasted_slots(cluster.coordinator.url, cluster.token, MODEL, MAX_BATCH)
        outcomes = send()
    return {"outcomes": outcomes, "lockout_s": probe.lockout_s, "probes": probe.probes,
            "bad_requests_not_refused": not_refused,
            "rss_growth_mb": max(peak[pid] - before[pid] for pid in pids)}


def slots_held(url: str) -> int:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    match = re.search(r"^cacheflow_coordinator_slots_held (\S+)$", metrics, re.MULTILINE)
    if match is None:
        raise RuntimeError("the coordinator exports no cacheflow_coordinator_slots_held")
    return int(float(match.group(1)))


# -- the summary ----------------------------------------------------------------------------------------
def wrong_answers(reference: list[dict[str, Any]], outcomes: list[dict[str, Any]]) -> int:
    return sum(1 for ref, got in zip(reference, outcomes, strict=True)
               if "error" not in got and got["token_ids"] != ref["token_ids"])


def in_flight_at(outcomes: list[dict[str, Any]], killed_at: float) -> int:
    """Requests sent before the kill and answered after it."""
    return sum(1 for r in outcomes if r["sent_s"] <= killed_at <= r["answered_s"])


def summary_of(phases: dict[str, Any]) -> dict[str, Any]:
    ref = phases["reference"]
    runs = {name: phases[name]["outcomes"] for name in ("pod_kill", "worker_kill", "abuse", "worker_attacks",
                                                        "fill_pools")}
    failed = {name: sum("error" in r for r in outcomes) for name, outcomes in runs.items()}
    worker, attacks = phases["worker_kill"], phases["worker_attacks"]
    return {"requests": sum(len(o) for o in runs.values()), "failed_requests": sum(failed.values()),
            "failed_by_phase": failed,
            "worker_kill_in_flight": in_flight_at(worker["outcomes"], worker["killed_at"]),
            "wrong_answers": sum(wrong_answers(ref, o) for o in runs.values()),
            "leaked_slots": phases["leaked_slots"], "pod_kill_failed_requests": failed["pod_kill"],
            "worker_kill_recovery_s": worker["recovery_s"], "lockout_s": phases["abuse"]["lockout_s"],
            "max_rss_growth_mb": phases["abuse"]["rss_growth_mb"],
            "bad_requests_not_refused": phases["abuse"]["bad_requests_not_refused"],
            "worker_api_attacks_sent": attacks["sent"],
            "worker_routes_without_grant": len(attacks["routes_without_grant"]),
            "worker_api_unauthenticated_accepted": attacks["unauthenticated_accepted"],
            "worker_api_ungranted_accepted": attacks["ungranted_accepted"],
            "grant_replay_accepted": attacks["replay_accepted"],
            "worker_route_cells": attacks["cells"],
            "poisoned_answers": wrong_answers(ref, attacks["outcomes"]),
            "stranger_memory_growth_mb": attacks["strangers"]["memory_growth_mb"],
            "slowloris_open_after_s": phases["slowloris"]["open_after_s"],
            "other_tenant_refused_while_one_fills_pool": phases["fill_pools"]["refused"],
            "idle_connection_restore_redone": phases["idle"]["restores_redone"] + phases["idle"]["failed"]}


TARGETS = {"failed_requests": "only requests in flight on the killed worker", "wrong_answers": "0",
           "leaked_slots": "0", "pod_kill_failed_requests": "0", "worker_kill_recovery_s": "<= 15",
           "lockout_s": "0", "max_rss_growth_mb": "<= 256", "bad_requests_not_refused": "0",
           "worker_api_unauthenticated_accepted": "0", "worker_api_ungranted_accepted": "0", "poisoned_answers": "0",
           "worker_routes_without_grant": "0", "grant_replay_accepted": "0", "stranger_memory_growth_mb": "<= 16",
           "slowloris_open_after_s": "<= 10", "other_tenant_refused_while_one_fills_pool": "0",
           "idle_connection_restore_redone": "0"}


def report(args: argparse.Namespace, requests: list[ReplayRequest], phases: dict[str, Any]) -> None:
    summary = summary_of(phases)
    out = results_dir(args)
    body = {"summary": summary, "machine": machine_facts(), "command": command_line(), "quick": args.quick,
            "requests": [r.trace.request_id for r in requests], "rate_gbps_per_pod_emulated": args.rate_gbps,
            "link": {"emulated": True, "gbps_per_pod": args.rate_gbps,
                     "chosen": "the fixed --rate-gbps, not calibrated to a Tio/Tcomp ratio"},
            "phases": {k: v for k, v in phases.items() if k != "reference"}}
    write_json(out / "chaos.json", body)
    rows = [[key, _shown(summary[key]), TARGETS.get(key, "")] for key in summary
            if key not in ("failed_by_phase", "worker_route_cells")]
    cells = summary["worker_route_cells"]
    classes = list(next(iter(cells.values())))
    route_rows = [[route, *(str(by_class[c]) for c in classes)] for route, by_class in cells.items()]
    failed = ", ".join(f"{k} {v}" for k, v in summary["failed_by_phase"].items())
    facts = body["machine"]
    lines = ["# Chaos: kills and abuse on a supervised local cluster", "",
             f"Machine: {facts['cpu']}, {facts['cpus']} CPUs; git {facts['git']}. Command: `{body['command']}`.",
             f"{len(requests)} trace requests per replay, {NEW_TOKENS} tokens each, links shaped (emulated) to "
             f"{args.rate_gbps} Gbit/s per pod; the pod and the worker are killed {args.kill_after_s} s into "
             f"their replays. Failed requests by phase: {failed}; requests in flight on the worker when it was "
             f"killed: {summary['worker_kill_in_flight']}.", "",
             markdown_table(["key", "measured", "target"], rows), "",
             "Worker routes x credential classes: attacks accepted (summed over the stages; 0 everywhere is the "
             "target). A replay counts only its second use.", "",
             markdown_table(["route", *classes], route_rows), ""]
    (out / "chaos.md").write_text("\n".join(lines))
    print(f"summary: {summary}")


def _shown(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
