"""`cacheflow up`: start the local cluster, say where everything listens, keep it serving until stopped.

Before anything starts it checks the model and the coordinator's port and takes the cluster directory's
lock (a second `cacheflow up` on either fails there, in one line); without a `profile` in the spec it
profiles the model on this machine once (a quick profile, reused afterwards), so that the CacheFlow
policies run as themselves rather than as Cake. Each process is reported as it is ready. While it
serves, a process that exits is restarted (`supervisor.py`). SIGTERM, SIGINT (Ctrl-C), SIGHUP or an
error stop every process it started, at any point; the processes also stop if `cacheflow up` is killed.

With `--demo`, it sends one long prompt twice through the coordinator instead of waiting: the first
is prefilled and stored, the second restores the stored prefix; it prints both TTFTs and stops.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

from cacheflow_common.errors import CacheFlowError
from cacheflow_services import scrape_config
from cacheflow_services.http_server import http_client
from cacheflow_services.local_cluster import ClusterSpec, LocalCluster, hold_workdir, preflight, start_cluster
from cacheflow_services.local_process import Stopped, exit_on_signals, print_ready, raise_if_stopped, reporting_ready
from cacheflow_services.profiling import ensure_quick_profile
from cacheflow_services.supervisor import Supervisor

DEMO_TEXT = ("CacheFlow restores the KV cache of a long prompt by recomputing its front while it loads its back "
             "from storage, meeting in the middle. ")
DEMO_STEPS = (("first (prefill, then stored)", "prefilling it through the stages and storing its KV chunks (the "
                                              "first request also warms the workers up: tens of seconds on a CPU)"),
              ("second (restored)", "the same prompt: its prefix is restored from storage, front recomputed while "
                                    "the back loads"))
PROFILE_TOKENS = 2048  # the longest prefix the quick profile times (as long as --demo's prompt)


def describe(cluster: LocalCluster, workdir: Path, model: str) -> str:
    lines = [f"coordinator  {cluster.coordinator.url}  (OpenAI-compatible: /v1/completions, /v1/chat/completions)",
             f"  token      {cluster.token}  (tenant {cluster.tenant!r}; also in {workdir / 'api-tokens'})"]
    lines += [f"stage {w.stage}      {w.url}" for w in cluster.workers]
    lines += [f"pod {i}        data 127.0.0.1:{p.data_port}  control http://127.0.0.1:{p.http_port}  ({p.transport})"
              for i, p in enumerate(cluster.pods)]
    lines += [f"logs         {workdir}",
              f"prometheus   prometheus --config.file={workdir / scrape_config.FILE_NAME}  (scrapes every process "
              "with the labels the chart's dashboard reads)", "",
              f"curl -s {cluster.coordinator.url}/v1/completions -H 'Authorization: Bearer {cluster.token}' "
              f"-H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", "
              "\"max_tokens\": 16}'"]
    return "\n".join(lines)


def demo(cluster: LocalCluster, model: str, prompt_tokens: int, workdir: Path) -> None:
    """The same long prompt twice: prefilled (and stored), then restored."""
    headers = {"Authorization": f"Bearer {cluster.token}"}
    with http_client(base_url=cluster.coordinator.url, headers=headers, timeout=600) as client:
        prompt: str | list[int] = (DEMO_TEXT * (prompt_tokens // 20 + 1))
        if model == "tiny":  # no tokenizer: token ids
            prompt = [(7 * i + 3) % 1000 for i in range(prompt_tokens)]
        for attempt, doing in DEMO_STEPS:
            print(f"{attempt} request, about {prompt_tokens} prompt tokens: {doing} ...", flush=True)
            began = time.perf_counter()
            r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8})
            if r.status_code != 200:
                raise CacheFlowError(f"the {attempt} request failed: HTTP {r.status_code}: "
                                     f"{' '.join(r.text[:300].split())} (logs in {workdir})")
            body = r.json()
            extra = body["cacheflow"]
            print(f"{attempt}: {body['usage']['prompt_tokens']} prompt tokens, "
                  f"{extra['prompt_tokens_restored']} restored from storage (policy {extra['policy']}, stage modes "
                  f"{', '.join(extra['stage_modes']) or '-'}), TTFT {extra['ttft_s']:.3f} s, "
                  f"total {time.perf_counter() - began:.3f} s: {body['choices'][0]['text']!r}", flush=True)
            time.sleep(1.0)  # the workers store the first request's chunks in the background


def with_profile(spec: ClusterSpec, cache_dir: Path) -> ClusterSpec:
    """The spec with a profile: its own, or the quick one measured here for its model and settings."""
    if spec.profile:
        return spec
    path = ensure_quick_profile(cache_dir, spec.model, dtype=spec.dtype, chunk_size=spec.chunk_size,
                                max_tokens=PROFILE_TOKENS, threads=spec.threads())
    return replace(spec, profile=str(path))


def run(args: argparse.Namespace, cache_dir: Path) -> int:
    spec = ClusterSpec.load(Path(args.spec) if args.spec else None, model=args.model, stages=args.stages,
                            pods=args.pods, port=args.port, directory=args.dir, tls=args.tls or None)
    workdir = spec.workdir(cache_dir)
    preflight(spec)  # a wrong model or a busy port fails here, before anything starts
    with exit_on_signals(), hold_workdir(workdir):  # ... and so does a directory another `up` holds
        try:
            return _start_and_serve(args, spec, workdir, cache_dir)
        except Stopped as stopped:
            print(f"cacheflow up: stopped by {stopped}", file=sys.stderr, flush=True)
            return 128 + stopped.signum


def _start_and_serve(args: argparse.Namespace, spec: ClusterSpec, workdir: Path, cache_dir: Path) -> int:
    spec = with_profile(spec, cache_dir)
    print(f"starting {spec.pods} storage pod(s), {spec.stages} stage worker(s) and a coordinator "
          f"for model {spec.model!r} (restore policy {spec.policy}; logs in {workdir}) ...", flush=True)
    with reporting_ready(print_ready):
        cluster = start_cluster(spec, workdir)
    try:
        scrape_config.write(cluster, workdir)
        print(describe(cluster, workdir, spec.model), flush=True)
        supervisor = cluster.supervise()
        if args.demo:
            demo(cluster, spec.model, args.demo_tokens, workdir)
            return 0
        return serve(supervisor, workdir)
    finally:
        print("stopping ...", flush=True)
        cluster.stop()


def serve(supervisor: Supervisor, workdir: Path) -> int:
    """Until a stop signal (0), or until a process keeps exiting however often it is restarted (1)."""
    print("\nserving (a process that exits is restarted); Ctrl-C stops everything", flush=True)
    try:
        while not (failed := supervisor.wait_failed(1.0)):
            raise_if_stopped()
    except Stopped:
        return 0
    print(f"{failed}; stopping (see the logs in {workdir})", flush=True)
    return 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser("up", help="start a local cluster (storage pods, stage workers, coordinator)")
    up.add_argument("--spec", default="", help="cluster spec YAML (every key optional; see services/local_cluster.py)")
    up.add_argument("--model", default=None, help="tiny | smollm2 | a model directory (default: smollm2)")
    up.add_argument("--stages", type=int, default=None, help="pipeline stages (default 2)")
    up.add_argument("--pods", type=int, default=None, help="storage pods (default 2)")
    up.add_argument("--port", type=int, default=None, help="coordinator port (default 8000; 0: any free one)")
    up.add_argument("--dir", default=None, help="chunks, tokens and logs (default: <cache>/cluster)")
    up.add_argument("--tls", action="store_true", help="TLS between the coordinator, the workers and the pods "
                    "(default: plain on loopback; a CA and certificate are made once in <dir>/internal/tls)")
    up.add_argument("--demo", action="store_true", help="send one long prompt twice (stored, then restored), stop")
    up.add_argument("--demo-tokens", type=int, default=2048, help="--demo: about this many prompt tokens")
