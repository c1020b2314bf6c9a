"""Stage benchmark: every stage restoring at once from boundary activations vs from the previous stage.

Real processes on loopback: `S` stage workers (each pinned to its own core, one torch thread) and
`S` storage pods, each shaped to the same link rate, so each stage has a link of its own as each GPU
of a pipeline has (per-stage costs Tcomp/S and Tio/S: docs/architecture.md, "The bound T*"). The rate
is calibrated so that Tio/Tcomp = 1 for one stage: the S = 1 compute-only restore time against the
prefix's KV bytes.

For each S, the same saved prefix is restored (client-side wall time of the whole restore) with:
* `boundary`: every stage from its stored boundary activations, all at once (CacheFlow);
* `pipelined`: stage s from stage s-1's output, streamed chunk by chunk (our fallback);
* `sequential`: stage s from stage s-1's output once s-1 is done (a pipeline-parallel engine's prefill).
All use the same two-pointer policy (`--policy`, token-wise). Also reported: the boundary bytes stored
and read, as a share of the KV bytes.

Writes bench/results/stages.{json,md,png}; the JSON's `summary` holds speedup_s2_vs_pipelined,
speedup_s2_vs_sequential and boundary_bytes_share (stored, at S = 2).
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

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
from cacheflow_common.auth import GrantIssuer, ensure_cluster_secrets
from cacheflow_common.kv.keys import object_name
from cacheflow_common.layer_split import balanced_split
from cacheflow_common.model.sources import RANDOM_SHAPES, load_model
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.boundary import boundary_name
from cacheflow_common.restore.save import make_job
from cacheflow_common.store.placement import ClusterStore
from cacheflow_common.transport.pod_client import PodAddress, PodClient
from cacheflow_services.coordinator.stage_chain import StageChain
from cacheflow_services.storage.launch import LocalPod, launch_pod
from cacheflow_services.worker.launch import LocalWorker, launch_stages

INPUTS = ("boundary", "pipelined", "sequential")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench stages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=["smollm2", *sorted(RANDOM_SHAPES)],
                   help="the real SmolLM2-135M (its boundary/KV byte ratio is a real model's), or a random shape")
    p.add_argument("--tokens", type=int, default=4096, help="prefix length")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--stages", default="", help="stage counts (default: 1, 2 and 4 where the cores allow)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--policy", default="cake", help="the two-pointer policy every stage uses (token-wise)")
    add_out_option(p)
    p.add_argument("--quick", action="store_true", help="smoke run: short prefix, one repeat")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.chunk_size, args.repeats = 512, 64, 1
    cores = len(os.sched_getaffinity(0))
    args.stage_counts = [int(s) for s in args.stages.split(",")] if args.stages else [s for s in (1, 2, 4)
                                                                                      if s <= cores]
    return args


class Cluster:
    """S pods shaped to `rate_gbps` (one token for all) and S workers pinned to cores 0..S-1."""

    def __init__(self, workdir: Path, args: argparse.Namespace, n_stages: int, rate_gbps: float,
                 n_layers: int) -> None:
        tokens = {"bench": secrets.token_urlsafe(24)}
        shaping = ["--rate-gbps", str(rate_gbps)] if rate_gbps else []
        self.pods: list[LocalPod] = []
        self.workers: list[LocalWorker] = []
        try:
            for i in range(n_stages):
                self.pods.append(launch_pod(workdir / f"pod{i}", *shaping, backend="memory", tokens=tokens))
            secrets_dir = ensure_cluster_secrets(workdir / "internal")
            self.pod_addresses = [PodAddress(f"pod-{i}", "127.0.0.1", p.data_port) for i, p in enumerate(self.pods)]
            cores = sorted(os.sched_getaffinity(0))
            self.workers = launch_stages(
                workdir, split=balanced_split(n_layers, n_stages), pods=[f"{a.pod_id}={a.host}:{a.port}"
                                                                          for a in self.pod_addresses],
                secrets=secrets_dir, model=args.model, chunk_size=args.chunk_size, policy=args.policy,
                cpus=[str(cores[s % len(cores)]) for s in range(n_stages)], threads=1)
        except BaseException:
            self.stop()
            raise
        self.store = ClusterStore({a.pod_id: PodClient(a, tokens["bench"]) for a in self.pod_addresses})
        self.chain = StageChain([w.url for w in self.workers], issuer=GrantIssuer.from_dir(secrets_dir, tokens),
                                timeout_s=600)

    def stored_bytes(self, model: Transformer, ids: list[int]) -> dict[str, int]:
        """Bytes the pods hold for the prompt: KV chunks of every stage, and boundary activations."""
        totals = {"kv": 0, "hidden": 0}
        for info in self.chain.info():
            a, b = info.layers
            job = make_job(model, ids, tenant="bench", chunk_size=info.chunk_size, layers=range(a, b))
            for key in job.keys:
                totals["kv"] += self.store.size(object_name(key, "kv", a, b)) or 0
                totals["hidden"] += (self.store.size(boundary_name(key, a)) or 0) if a else 0
        return totals

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        for p in self.pods:
            p.stop()


def _prompt(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(1000) for _ in range(n)]


def save_prompt(chain: StageChain, ids: list[int]) -> None:
    """A fresh prefill through the stages stores the prompt's KV and boundary activations."""
    chain.generate("save", ids, start=0, tenant="bench", max_new_tokens=1)
    for stage, url in enumerate(chain.urls):
        headers = chain.issuer.headers_for("flush", stages=[stage])
        httpx.post(f"{url}/v1/flush", headers=headers, timeout=600).raise_for_status()
    chain.release("save", "bench")


def timed_restore(chain: StageChain, ids: list[int], input_mode: str, policy: str, tag: str) -> dict[str, Any]:
    start = time.perf_counter()
    summaries = chain.restore(tag, ids, tenant="bench", input=input_mode, policy=policy)
    elapsed = time.perf_counter() - start
    chain.release(tag, "bench")
    return {"elapsed_s": elapsed, "stages": [summary.model_dump() for summary in summaries]}


def calibrate(workdir: Path, args: argparse.Namespace, ids: list[int], model: Transformer) -> tuple[float, int]:
    """(S = 1 compute-only restore seconds, KV bytes of the prompt): the link rate giving Tio/Tcomp = 1."""
    cluster = Cluster(workdir, args, 1, 0.0, model.config.num_layers)
    try:
        save_prompt(cluster.chain, ids)
        times = [timed_restore(cluster.chain, ids, "boundary", "compute-only", f"cal{r}")["elapsed_s"]
                 for r in range(args.repeats)]
        return median(times), cluster.stored_bytes(model, ids)["kv"]
    finally:
        cluster.stop()


def run_stage_count(workdir: Path, args: argparse.Namespace, ids: list[int], model: Transformer, n_stages: int,
                    rate_gbps: float) -> dict[str, Any]:
    cluster = Cluster(workdir, args, n_stages, rate_gbps, model.config.num_layers)
    try:
        save_prompt(cluster.chain, ids)
        stored = cluster.stored_bytes(model, ids)
        inputs = INPUTS if n_stages > 1 else INPUTS[:1]
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in inputs}
        for r in range(args.repeats):
            for mode in inputs:  # interleaved: a slow moment of the machine hits every mode alike
                runs[mode].append(timed_restore(cluster.chain, ids, mode, args.policy, f"{mode}{r}"))
        times = {m: median([run["elapsed_s"] for run in rs]) for m, rs in runs.items()}
        boundary_read = median([sum(s["boundary_bytes_read"] for s in run["stages"]) for run in runs["boundary"]])
        kv_read = median([sum(s["bytes_loaded"] for s in run["stages"]) for run in runs["boundary"]])
        print(f"  S={n_stages}: " + ", ".join(f"{m}={t:.3f}s" for m, t in times.items()), flush=True)
        return {"stages": n_stages, "times_s": times, "runs_s": {m: [x["elapsed_s"] for x in rs] for m, rs in
                                                                  runs.items()},
                "kv_bytes_stored": stored["kv"], "boundary_bytes_stored": stored["hidden"],
                "boundary_bytes_read": boundary_read, "kv_bytes_read": kv_read,
                "per_stage": runs["boundary"][-1]["stages"]}
    finally:
        cluster.stop()


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    by_s = {r["stages"]: r for r in rows}
    s1, s2 = by_s.get(1), by_s.get(2)
    summary: dict[str, Any] = {"speedup_s2_vs_pipelined": None, "speedup_s2_vs_sequential": None,
                               "speedup_s2_vs_s1": None, "boundary_bytes_share": None,
                               "boundary_bytes_read_share": None}
    if s2 is not None:
        t = s2["times_s"]
        summary.update(speedup_s2_vs_pipelined=t["pipelined"] / t["boundary"],
                       speedup_s2_vs_sequential=t["sequential"] / t["boundary"],
                       boundary_bytes_share=s2["boundary_bytes_stored"] / s2["kv_bytes_stored"],
                       boundary_bytes_read_share=s2["boundary_bytes_read"] / max(1, s2["kv_bytes_read"]))
        if s1 is not None:
            summary["speedup_s2_vs_s1"] = s1["times_s"]["boundary"] / t["boundary"]
    return summary


def write_markdown(path: Path, summary: dict[str, Any], rows: Sequence[dict[str, Any]], setup: dict[str, Any]) -> None:
    def fmt(x: float | None, digits: int = 3) -> str:
        return "n/a" if x is None else f"{x:.{digits}f}"

    head = ["S", *(f"{m} (s)" for m in INPUTS), "pipelined / boundary", "sequential / boundary",
            "boundary bytes stored / KV", "boundary bytes read / KV read"]
    table = []
    for r in rows:
        t = r["times_s"]
        table.append([r["stages"], *(fmt(t.get(m)) for m in INPUTS),
                      fmt(t["pipelined"] / t["boundary"] if "pipelined" in t else None),
                      fmt(t["sequential"] / t["boundary"] if "sequential" in t else None),
                      fmt(r["boundary_bytes_stored"] / r["kv_bytes_stored"]),
                      fmt(r["boundary_bytes_read"] / max(1, r["kv_bytes_read"]))])
    facts = machine_facts()
    text = (
        "# Stages: parallel restore from boundary activations vs restoring from the previous stage\n\n"
        f"Machine: {facts['cpu']}, {facts['cpus']} CPUs, torch {facts['torch']}; each worker pinned to one core, "
        f"one torch thread; git {facts['git']}.\n"
        f"Command: `{command_line()}`. Model `{setup['model']}`, prefix {setup['tokens']} tokens, "
        f"chunks of {setup['chunk_size']}, policy `{setup['policy']}`; S pods, each link emulated (a token bucket) "
        f"at {setup['rate_gbps']:.4f} Gbit/s, chosen so that Tio/Tcomp = 1 per stage (S = 1 compute-only "
        f"{setup['compute_only_s']:.3f} s for {setup['kv_bytes']} KV bytes). Times: median of {setup['repeats']}, "
        "modes interleaved.\n\n"
        "This bench compares where a stage's input comes from, not restore policies: every mode runs the same "
        f"policy (`{setup['policy']}`; Cake by default, which needs no cost model), so the comparison is "
        "policy-neutral; CacheFlow against Cake is in the restore, batch and vLLM benchmarks.\n\n"
        "| target | measured | goal |\n|---|---|---|\n"
        f"| S = 2: pipelined / boundary | {fmt(summary['speedup_s2_vs_pipelined'])} | >= 1.5 |\n"
        f"| S = 2: sequential / boundary | {fmt(summary['speedup_s2_vs_sequential'])} | |\n"
        f"| S = 1 / S = 2 (boundary) | {fmt(summary['speedup_s2_vs_s1'])} | ideal 2 |\n"
        f"| boundary bytes stored / KV bytes (S = 2) | {fmt(summary['boundary_bytes_share'])} | |\n\n"
        + markdown_table(head, table) + "\n"
    )
    path.write_text(text)


def plot(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.25
    for i, mode in enumerate(INPUTS):
        xs = [r["stages"] + (i - 1) * width for r in rows if mode in r["times_s"]]
        ys = [r["times_s"][mode] for r in rows if mode in r["times_s"]]
        ax.bar(xs, ys, width=width, label=mode)
    ax.set_xticks([r["stages"] for r in rows])
    ax.set_xlabel("pipeline stages S")
    ax.set_ylabel("restore time (s)")
    ax.set_title("Restore time by stage input")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    model = load_model(args.model, dtype=torch.float32)  # only for chunk names (fingerprint and keys)
    ids = _prompt(args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        print("[calibrate] S=1 compute-only", flush=True)
        compute_s, kv_bytes = calibrate(Path(tmp) / "cal", args, ids, model)
        rate_gbps = kv_bytes * 8 / compute_s / 1e9
        print(f"  {compute_s:.3f} s for {kv_bytes} bytes: links of {rate_gbps:.4f} Gbit/s", flush=True)
        rows = [run_stage_count(Path(tmp) / f"s{s}", args, ids, model, s, rate_gbps) for s in args.stage_counts]
    summary = summarize(rows)
    setup = {"model": args.model, "tokens": args.tokens, "chunk_size": args.chunk_size, "policy": args.policy,
             "repeats": args.repeats, "rate_gbps": rate_gbps, "compute_only_s": compute_s, "kv_bytes": kv_bytes,
             "link": {"emulated": True, "gbps": rate_gbps,
                      "chosen": "the KV bytes over the S = 1 compute-only restore time: Tio/Tcomp = 1 per stage"}}
    out = results_dir(args)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "stages.json", {"summary": summary, "setup": setup, **provenance(args.quick), "rows": rows})
    write_markdown(out / "stages.md", summary, rows, setup)
    plot(out / "stages.png", rows)
    print("summary: " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
