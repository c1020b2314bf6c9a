"""Fixed costs of the service: what every HTTP hop, a lone request's restore and a decode step cost
beyond the work itself, on a local cluster of the tiny model (so the work is small and the fixed
costs show), every process on loopback as `cacheflow up` starts them.

* round trips: keep-alive GETs (and a small POST where a route takes one without a grant) to every
  service's HTTP port, median and P99 per service;
* a lone restore's fixed cost: a prefix stored once, then restored alone again and again (one request
  at a time, so no batching); the coordinator's restore time minus the slowest stage's own (admitted to
  its engine -> the pointers met): the hops, grants and lookups around the restore;
* decode: a completion's time per generated token after its first (every token crosses every stage).

Each is measured twice: with the internal hops in plain TCP (as `cacheflow up` runs by default) and
with TLS on them (as the chart runs by default): the `tls_*` keys, and TLS's overhead beside them.
`--before FILE` joins an earlier run's JSON (e.g. on the commit before a change) to the report, side by
side. Writes bench/results/latency.{json,md}; the JSON's `summary` holds `http_round_trip_ms_max`,
`lone_restore_fixed_cost_ms`, `decode_ms_per_token`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from cacheflow_bench.common import (
    add_out_option,
    command_line,
    machine_facts,
    markdown_table,
    median,
    provenance,
    results_dir,
    write_json,
)
from cacheflow_services.local_cluster import ClusterSpec, LocalCluster, start_cluster

CHUNK = 32
MODEL = "tiny"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--round-trips", type=int, default=300, help="keep-alive requests per service")
    p.add_argument("--restores", type=int, default=30, help="lone restores of the stored prefix")
    p.add_argument("--prefix-chunks", type=int, default=4, help=f"chunks ({CHUNK} tokens) of the restored prefix")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--transport", default="auto", help="the pods' data plane: auto | tcp | nixl")
    p.add_argument("--before", default="", help="an earlier run's latency.json, reported beside this one")
    add_out_option(p)
    p.add_argument("--quick", action="store_true", help="smoke run: few requests of each kind")
    args = p.parse_args(argv)
    if args.quick:
        args.round_trips, args.restores, args.decode_tokens = 20, 3, 8
    return args


def _timed(call: Callable[[], httpx.Response], times: int) -> list[float]:
    """Seconds of each of `times` calls on a warm keep-alive connection (the first one warms it)."""
    call().raise_for_status()
    out = []
    for _ in range(times):
        began = time.perf_counter()
        call().raise_for_status()
        out.append(time.perf_counter() - began)
    return out


def _p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))]


def round_trips(cluster: LocalCluster, times: int) -> list[dict[str, Any]]:
    """Keep-alive round trips to every service's HTTP port, as a client of each would make them."""
    rows = []
    tls = cluster.workers[0].tls
    # a plain httpx client, as the services' users and probes have (trusting the cluster CA under TLS)
    with httpx.Client(timeout=30, verify=tls.client_context() if tls else True) as client:
        bases = [("coordinator", cluster.coordinator.url), *((f"stage {w.stage}", w.url) for w in cluster.workers),
                 *((f"pod {i}", p.url("")) for i, p in enumerate(cluster.pods))]
        for name, base in bases:
            rows.append(_row(name, "GET /healthz", _timed(partial(client.get, f"{base}/healthz"), times)))
        body = {"names": ["0" * 32 + ".kv.L0-1"]}
        for i, pod in enumerate(cluster.pods):
            url, headers = pod.url("/v1/chunks/exists"), pod.headers(cluster.tenant)
            rows.append(_row(f"pod {i}", "POST /v1/chunks/exists",
                             _timed(partial(client.post, url, json=body, headers=headers), times)))
    return rows


def _row(service: str, call: str, seconds: list[float]) -> dict[str, Any]:
    return {"service": service, "call": call, "median_ms": median(seconds) * 1e3, "p99_ms": _p99(seconds) * 1e3,
            "min_ms": min(seconds) * 1e3}


def _complete(client: httpx.Client, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, **extra})
    r.raise_for_status()
    return dict(r.json())


def lone_restores(cluster: LocalCluster, client: httpx.Client, args: argparse.Namespace) -> list[dict[str, float]]:
    """The stored prefix restored alone, again and again: each restore's time on the coordinator and in
    the slowest stage's engine."""
    prompt = [(7 * i + 3) % 1000 for i in range(args.prefix_chunks * CHUNK + 1)]
    _complete(client, prompt, 1)  # prefilled and stored
    for worker in cluster.workers:
        worker.flush()
    rows = []
    for _ in range(args.restores + 1):  # the first warms the restore path
        extra = _complete(client, prompt, 1, save=False)["cacheflow"]
        if extra["prompt_tokens_restored"] != args.prefix_chunks * CHUNK:
            raise RuntimeError(f"restored {extra['prompt_tokens_restored']} tokens, not the stored prefix")
        engine_s = max(s["elapsed_s"] for s in extra["stages"])
        rows.append({"restore_s": extra["restore_s"], "engine_s": engine_s, "ttft_s": extra["ttft_s"],
                     "fixed_s": extra["restore_s"] - engine_s})
    return rows[1:]


def decode(client: httpx.Client, tokens: int) -> float:
    """Seconds per generated token after the first, for a short prompt (nothing to restore)."""
    began = time.perf_counter()
    body = _complete(client, [5, 6, 7], tokens, ignore_eos=True, save=False)
    wall = time.perf_counter() - began
    generated = body["usage"]["completion_tokens"]
    return (wall - body["cacheflow"]["ttft_s"]) / max(1, generated - 1)


def measure(args: argparse.Namespace, *, tls: bool) -> dict[str, Any]:
    spec = ClusterSpec(model=MODEL, stages=2, pods=2, chunk_size=CHUNK, dtype="float32", policy="cake", port=0,
                       transport=args.transport, threads_per_stage=1, batch_window_ms=20.0, tls=tls)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = start_cluster(spec, Path(tmp))
        try:
            trips = round_trips(cluster, args.round_trips)
            headers = {"Authorization": f"Bearer {cluster.token}"}
            with httpx.Client(base_url=cluster.coordinator.url, headers=headers, timeout=300) as client:
                restores = lone_restores(cluster, client, args)
                per_token = [decode(client, args.decode_tokens) for _ in range(3)]
        finally:
            cluster.stop()
    summary = {
        "http_round_trip_ms_max": max(r["median_ms"] for r in trips),
        "http_round_trip_p99_ms_max": max(r["p99_ms"] for r in trips),
        "lone_restore_fixed_cost_ms": median([r["fixed_s"] for r in restores]) * 1e3,
        "lone_restore_ms": median([r["restore_s"] for r in restores]) * 1e3,
        "lone_restore_engine_ms": median([r["engine_s"] for r in restores]) * 1e3,
        "lone_ttft_ms": median([r["ttft_s"] for r in restores]) * 1e3,
        "decode_ms_per_token": median(per_token) * 1e3,
    }
    return {"summary": summary, "round_trips": trips, "restores": restores, "decode_s_per_token": per_token,
            "setup": {"model": MODEL, "stages": 2, "pods": 2, "chunk_size": CHUNK, "transport": args.transport,
                      "prefix_tokens": args.prefix_chunks * CHUNK, "tls": tls}}


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    body = {**measure(args, tls=False), **provenance(args.quick)}
    with_tls = measure(args, tls=True)
    body["tls"] = with_tls
    for key in ("http_round_trip_ms_max", "lone_restore_fixed_cost_ms", "decode_ms_per_token"):
        body["summary"][f"tls_{key}"] = with_tls["summary"][key]
        body["summary"][f"tls_overhead_{key}"] = with_tls["summary"][key] - body["summary"][key]
    if args.before:
        before = json.loads(Path(args.before).read_text())
        body["before"] = {"summary": before["summary"], "git": before["machine"]["git"]}
    out = results_dir(args)
    write_json(out / "latency.json", body)
    (out / "latency.md").write_text(_markdown(body))
    s = body["summary"]
    print(f"round trip max {s['http_round_trip_ms_max']:.2f} ms, lone restore fixed cost "
          f"{s['lone_restore_fixed_cost_ms']:.1f} ms, decode {s['decode_ms_per_token']:.1f} ms/token")
    return 0


TARGETS = {"http_round_trip_ms_max": "<= 2", "lone_restore_fixed_cost_ms": "<= 5"}


def _markdown(body: dict[str, Any]) -> str:
    facts, s = machine_facts(), body["summary"]
    before = body.get("before", {}).get("summary", {})
    head = ["measure", "this run"] + ([f"before ({body['before']['git']})"] if before else []) + ["target"]
    rows = [[k, v] + ([before.get(k, "-")] if before else []) + [TARGETS.get(k, "")] for k, v in s.items()]
    lines = ["# Fixed costs", "",
             f"Machine: {facts['cpu']}, {facts['cpus']} CPUs; git {facts['git']}. Command: `{command_line()}`.", "",
             "A local cluster of the tiny model (2 stages, 2 pods, loopback): the work is small, so what shows is "
             "what every request pays around it. Times in ms.", "",
             markdown_table(head, rows), "",
             markdown_table(["service", "call", "median ms", "P99 ms", "min ms", "with TLS: median ms"],
                            [[r["service"], r["call"], r["median_ms"], r["p99_ms"], r["min_ms"], t["median_ms"]]
                             for r, t in zip(body["round_trips"], body["tls"]["round_trips"], strict=True)]), "",
             "TLS is on the internal hops only (coordinator -> workers, worker -> worker, workers -> pods' data "
             "plane); the coordinator's public port and the pods' control ports stay plain HTTP.", "",
             f"Lone restores: {len(body['restores'])}; restore time spread (ms): min "
             f"{min(r['restore_s'] for r in body['restores']) * 1e3:.1f}, "
             f"stdev {statistics.pstdev([r['restore_s'] for r in body['restores']]) * 1e3:.1f}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
