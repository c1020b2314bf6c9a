"""The `cacheflow` command. Each pod of a deployment runs one subcommand of it."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from cacheflow_common.errors import CacheFlowError
from cacheflow_common.model.sources import check_model
from cacheflow_services import up
from cacheflow_services.demo import run as demo_run
from cacheflow_services.service_flags import add_service_flags, limits_of, tls_of


def default_cache_dir() -> Path:
    import os

    return Path(os.environ.get("CACHEFLOW_CACHE", Path.home() / ".cache" / "cacheflow"))


def default_profile_path(model: str) -> Path:
    return default_cache_dir() / f"profile-{model.replace('/', '_')}.json"


def _profile(args: argparse.Namespace) -> int:
    from cacheflow_common.engine import NEVER_TOKEN_WISE, ProfileSettings
    from cacheflow_services.profiling import measure

    settings = (ProfileSettings.quick(args.chunk_size, args.max_tokens) if args.quick
                else ProfileSettings(chunk_size=args.chunk_size, max_tokens=args.max_tokens))
    profile = measure(args.model, dtype=args.dtype, settings=settings, threads=args.threads, store=args.store)
    out = Path(args.out).expanduser() if args.out else default_profile_path(args.model)
    profile.save(out)
    print(f"profile written to {out}")
    for c in profile.crossovers:
        never = c.l_delta == NEVER_TOKEN_WISE
        l_delta = "never (layer-wise wins at the longest profiled length)" if never else f"{c.l_delta} tokens"
        print(f"  link {c.link_bytes_per_s * 8 / 1e9:.3f} Gbit/s: L_delta = {l_delta}")
    return 0


# `cacheflow bench NAME` -> its module in cacheflow_bench
BENCHMARKS = {"restore": "restore_single", "storage": "storage", "stages": "parallel_stages", "batch": "batch",
              "latency": "latency", "vllm": "vllm", "report": "report", "chaos": "chaos", "sweep": "sweep",
              "sched-scale": "sched_scale", "vllm-compat": "vllm_compat", "vllm-eagle": "vllm_eagle",
              "vllm-stall": "vllm_stall"}


def _bench(args: argparse.Namespace) -> int:
    """Hand the rest of the command line (`--help` included) to the benchmark's own parser."""
    import importlib

    bench_main = importlib.import_module(f"cacheflow_bench.{BENCHMARKS[args.name]}").main
    return int(bench_main(list(args.args)))


def _storage(args: argparse.Namespace) -> int:
    from cacheflow_common.transport.shaping import gbps
    from cacheflow_common.units import parse_bytes
    from cacheflow_services.storage.config import StorageConfig, parse_tenant_shares, read_token_file
    from cacheflow_services.storage.main import serve

    config = StorageConfig(
        backend=args.backend,
        directory=Path(args.dir).expanduser() if args.dir else None,
        redis_url=args.redis_url,
        capacity_bytes=parse_bytes(args.capacity),
        rate_bytes_per_s=gbps(args.rate_gbps),
        link_capacity_bytes_per_s=gbps(args.link_capacity_gbps),
        transport=args.transport,
        host=args.host,
        data_port=args.data_port,
        http_port=args.http_port,
        tokens=read_token_file(Path(args.token_file)),
        tenant_shares=parse_tenant_shares(args.tenant_share),
        max_object_bytes=parse_bytes(args.max_object),
        max_buffered_bytes=parse_bytes(args.max_buffered),
        max_connections=args.max_connections,
        max_tenant_connections=args.max_tenant_connections,
        max_pending_connections=args.max_pending_connections,
        hello_timeout_s=args.hello_timeout,
        idle_timeout_s=args.idle_timeout,
    )
    serve(config, tls=tls_of(args), limits=limits_of(args))
    return 0


def _add_storage_parser(sub: argparse._SubParsersAction) -> None:
    st = sub.add_parser("storage", help="run a storage pod (chunk store + data plane)")
    st.add_argument("--backend", default="filesystem", choices=["filesystem", "memory", "redis"])
    st.add_argument("--dir", default="", help="filesystem backend: the directory chunks live in")
    st.add_argument("--redis-url", default="", help="redis backend: redis://host:port/db")
    st.add_argument("--capacity", default="0", help="evict LRU above this size, e.g. 100GiB (0: no limit)")
    st.add_argument("--rate-gbps", type=float, default=0.0, help="shape outgoing bytes to this link rate (0: unshaped)")
    st.add_argument("--link-capacity-gbps", type=float, default=0.0,
                    help="the outgoing link's capacity, for I/O utilisation metrics (0: the --rate-gbps shaping rate, "
                         "else the network interface's speed, else 10)")
    st.add_argument("--transport", default="auto", choices=["auto", "tcp", "nixl"],
                    help="auto: TCP, what the cluster's workers read over; nixl: also NIXL, for readers that bring it")
    st.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    st.add_argument("--data-port", type=int, default=0, help="data-plane port (0: any free one)")
    st.add_argument("--http-port", type=int, default=0, help="control API port (0: any free one)")
    st.add_argument("--token-file", required=True, help="file of 'tenant token' lines (a mounted Secret)")
    st.add_argument("--max-object", default="256MiB", help="largest object stored or read at once")
    st.add_argument("--max-buffered", default="1GiB", help="request bytes held in memory at once, all connections")
    st.add_argument("--tenant-share", action="append", default=[], metavar="TENANT=SIZE",
                    help="capacity guaranteed to a tenant (repeatable); the others split what is left evenly")
    st.add_argument("--max-connections", type=int, default=256, help="authenticated data-plane connections")
    st.add_argument("--max-tenant-connections", type=int, default=0,
                    help="of those, per tenant (0: max-connections split evenly between the tenants)")
    st.add_argument("--max-pending-connections", type=int, default=64,
                    help="connections not yet authenticated; one more closes the oldest")
    st.add_argument("--hello-timeout", type=float, default=5.0, help="seconds a connection has to authenticate")
    st.add_argument("--idle-timeout", type=float, default=60.0, help="close a connection idle this many seconds")
    add_service_flags(st, tls_help="the data plane serves TLS to clients that open with a TLS handshake")


def _worker(args: argparse.Namespace) -> int:
    from cacheflow_common.transport.pod_client import PodAddress
    from cacheflow_services.worker.config import WorkerConfig, parse_layers
    from cacheflow_services.worker.main import serve
    from cacheflow_services.worker.trust import WorkerTrust

    torch.set_num_threads(args.threads)
    config = WorkerConfig(
        stage=args.stage,
        layers=parse_layers(args.layers),
        last_stage=not args.next_stage,
        model=args.model,
        dtype=args.dtype,
        chunk_size=args.chunk_size,
        pods=tuple(PodAddress.parse(p) for p in args.pods.split(",") if p),
        replicas=args.replicas,
        next_stage=args.next_stage,
        policy=args.policy,
        profile=Path(args.profile) if args.profile else None,
        link_gbps=args.link_gbps,
        step_tokens=args.step_tokens,
        prefill_tokens=args.prefill_tokens,
        beside_forward_tokens=args.beside_forward_tokens,
        pool_tokens=args.pool_tokens,
        tenant_pool_share=args.tenant_pool_share,
        hold_ttl_s=args.hold_ttl_s,
        upstream_timeout_s=args.upstream_timeout_s,
        tls=tls_of(args),
        limits=limits_of(args),
        host=args.host,
        http_port=args.http_port,
    )
    serve(config, WorkerTrust.from_files(args.internal_token_file, args.grant_key_file))
    return 0


def _add_worker_parser(sub: argparse._SubParsersAction) -> None:
    wk = sub.add_parser("worker", help="run a stage worker (restores and runs layers a:b of the model)")
    wk.add_argument("--stage", type=int, required=True, help="pipeline stage, 0-based")
    wk.add_argument("--layers", required=True, help="the stage's layers, a:b")
    wk.add_argument("--model", default="tiny", help="tiny | smollm2 | qwen3-8b | a model directory")
    wk.add_argument("--dtype", default="auto", help="compute dtype (auto: bfloat16 where fast, else float32)")
    wk.add_argument("--chunk-size", type=int, default=256, help="restore chunk size in tokens (same on all stages)")
    wk.add_argument("--pods", required=True, help="storage pods: [id=]host:port,... (their data-plane ports)")
    wk.add_argument("--internal-token-file", required=True,
                    help="the cluster's internal token: every call to this worker must carry it")
    wk.add_argument("--grant-key-file", required=True,
                    help="the coordinator's grant verifying key (Ed25519 public key, PEM): work only on its grants")
    wk.add_argument("--replicas", type=int, default=1, help="copies of each saved chunk")
    wk.add_argument("--next-stage", default="", help="control URL of the next stage (none on the last)")
    wk.add_argument("--policy", default="cacheflow", help="restore policy (the CacheFlow ones need --profile)")
    wk.add_argument("--profile", default="", help="profile file from `cacheflow profile`")
    wk.add_argument("--link-gbps", type=float, default=None,
                    help="each storage pod's link rate, if known (load-time predictions; else learnt from loads)")
    wk.add_argument("--step-tokens", type=int, default=2048,
                    help="the compute loop's token budget per step (restore units, prefill slices, decode tokens)")
    wk.add_argument("--prefill-tokens", type=int, default=2048,
                    help="compute-only restores recompute the prefix in units this long")
    wk.add_argument("--beside-forward-tokens", type=int, default=0,
                    help="restore tokens a step carries beside forward work (one unit always fits)")
    wk.add_argument("--pool-tokens", type=int, default=1 << 17, help="KV pool capacity in tokens")
    wk.add_argument("--tenant-pool-share", type=float, default=0.5,
                    help="the most of the pool one tenant may hold at once (1: no cap, for a single tenant)")
    wk.add_argument("--hold-ttl-s", type=float, default=600.0, help="free a request's KV unused this long")
    wk.add_argument("--upstream-timeout-s", type=float, default=30.0,
                    help="pipelined restore: longest wait for the previous stage's next chunk")
    wk.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    wk.add_argument("--host", default="127.0.0.1", help="address to listen on (the pod's IP in a pod)")
    wk.add_argument("--http-port", type=int, default=0, help="API port (0: any free one)")
    add_service_flags(wk, tls_help="serve HTTPS, call the next stage and the storage pods over TLS")


def _coordinator(args: argparse.Namespace) -> int:
    from cacheflow_common.auth import read_secret
    from cacheflow_common.transport.pod_client import PodAddress
    from cacheflow_services.coordinator.config import CoordinatorConfig
    from cacheflow_services.coordinator.main import serve
    from cacheflow_services.coordinator.tokenizer import tokenizer_dir
    from cacheflow_services.storage.config import read_token_file

    tokenizer = Path(args.tokenizer) if args.tokenizer not in ("", "auto", "none") else None
    config = CoordinatorConfig(
        stages=tuple(u for u in args.stages.split(",") if u),
        pods=tuple(PodAddress.parse(p) for p in args.pods.split(",") if p),
        pod_tokens={tenant: token for token, tenant in read_token_file(Path(args.pod_token_file)).items()},
        api_tokens=read_token_file(Path(args.token_file)),
        internal_token=read_secret(args.internal_token_file, "internal token file").decode(),
        grant_signing_key=read_secret(args.grant_signing_key_file, "grant signing key file"),
        model_name=args.model,
        tokenizer=tokenizer_dir(args.model) if args.tokenizer == "auto" else tokenizer,
        replicas=args.replicas,
        policy=args.policy,
        batch_window_s=args.batch_window_ms / 1e3,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        slot_stuck_s=args.slot_stuck_s,
        max_held_restores=args.max_held_restores,
        stage_wait_s=args.stage_wait_s,
        stage_restart_wait_s=args.stage_restart_wait_s,
        restarts_file=args.restarts_file,
        tls=tls_of(args),
        host=args.host,
        http_port=args.http_port,
    )
    serve(config, limits=limits_of(args))
    return 0


def _add_coordinator_parser(sub: argparse._SubParsersAction) -> None:
    co = sub.add_parser("coordinator", help="run the restore coordinator (OpenAI-compatible API, batching)")
    co.add_argument("--stages", required=True, help="stage workers' URLs, in stage order, comma-separated")
    co.add_argument("--pods", required=True, help="storage pods: [id=]host:port,... (as the workers have them)")
    co.add_argument("--pod-token-file", required=True, help="'tenant token' lines for the storage pods")
    co.add_argument("--token-file", required=True, help="'tenant token' lines: the clients' bearer tokens")
    co.add_argument("--internal-token-file", required=True, help="the cluster's internal token (for the workers)")
    co.add_argument("--grant-signing-key-file", required=True,
                    help="Ed25519 private key (PEM) that signs each request's grant to the workers")
    co.add_argument("--model", default="tiny", help="the model the workers serve (clients name it)")
    co.add_argument("--tokenizer", default="auto", help="tokenizer directory; auto: the model's own; none")
    co.add_argument("--replicas", type=int, default=1, help="copies of each chunk (as the workers store them)")
    co.add_argument("--policy", default="cacheflow", help="restore policy of a request that names none "
                    "(the CacheFlow ones run as Cake on workers without a profile)")
    co.add_argument("--batch-window-ms", type=float, default=20.0, help="a batch forms within this window ...")
    co.add_argument("--max-batch", type=int, default=8, help="... or at this many requests (the most at once)")
    co.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond the batch; more get 429")
    co.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body (larger: 413)")
    co.add_argument("--slot-stuck-s", type=float, default=900.0,
                    help="not ready (/readyz 503) while every batch slot has been held longer than this")
    co.add_argument("--stage-wait-s", type=float, default=30.0,
                    help="a request waits this long for a stage that is down (restarting) before a 503")
    co.add_argument("--stage-restart-wait-s", type=float, default=180.0,
                    help="... or, while the supervisor says it is restarting the stage, up to this long in all")
    co.add_argument("--restarts-file", type=Path, default=None,
                    help="the supervisor's restart state (`cacheflow up` passes its own)")
    co.add_argument("--max-held-restores", type=int, default=16,
                    help="restores (POST /v1/restore) one tenant may have queued, running or held at once")
    co.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    co.add_argument("--http-port", type=int, default=0, help="API port (0: any free one)")
    add_service_flags(co, tls_help="call the stage workers (https:// --stages) and the storage pods over TLS; "
                                   "the public API stays plain HTTP (terminate TLS in front of it)")


def _operator(args: argparse.Namespace) -> int:
    from cacheflow_operator.main import run  # the `operator` extra (kopf, kubernetes)

    return run(namespaces=args.namespace, clusterwide=args.all_namespaces, liveness_port=args.liveness_port)


def _add_operator_parser(sub: argparse._SubParsersAction) -> None:
    op = sub.add_parser("operator", help="run the Kubernetes operator (reconciles CacheFlowCluster resources)")
    op.add_argument("--namespace", action="append", default=[], help="watch this namespace (repeatable)")
    op.add_argument("--all-namespaces", action="store_true", help="watch every namespace (needs a ClusterRole)")
    op.add_argument("--liveness-port", type=int, default=8080, help="serve /healthz here (0: off)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cacheflow", description="CacheFlow KV-cache restoration")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    prof = sub.add_parser("profile", help="measure this machine's compute/load costs and L_delta")
    prof.add_argument("--model", default="smollm2", help="tiny | smollm2 | a model directory (default: smollm2)")
    prof.add_argument("--dtype", default="auto", help="compute dtype; auto: bfloat16 where the CPU/GPU runs it fast")
    prof.add_argument("--chunk-size", type=int, default=256, help="restore chunk size in tokens")
    prof.add_argument("--max-tokens", type=int, default=4096, help="longest prefix timed for the fits")
    prof.add_argument("--store", default="memory", help="store to time reads from: memory | filesystem:DIR")
    prof.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads")
    prof.add_argument("--quick", action="store_true", help="one timing per point and one link ratio (a demo's profile)")
    prof.add_argument("--out", default="", help="profile file (default: the cache directory)")

    sec = sub.add_parser("secrets", help="create a cluster's internal token and grant keys in DIR (once; kept)")
    sec.add_argument("dir", help="where: the coordinator reads internal-token and grant-signing-key.pem, the "
                                 "workers internal-token and grant-verify-key.pem")

    _add_storage_parser(sub)
    _add_worker_parser(sub)
    _add_coordinator_parser(sub)
    _add_operator_parser(sub)
    up.add_parser(sub)
    demo_run.add_parser(sub)

    bench = sub.add_parser("bench", help="run a benchmark (`cacheflow bench NAME --help`: its options)")
    bench.add_argument("name", choices=list(BENCHMARKS),
                       help="restore: single-request restore vs the bound; storage: data-plane rates; "
                            "stages: parallel stages from boundary activations vs pipelined; "
                            "batch: trace replay per policy and batch size, and the simulator; "
                            "vllm: vLLM's TTFT with the connector (needs .venv-vllm); "
                            "report: REPORT.md with the paper's figures from the results (--run: the suite first)")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options (NAME --help)")
    return parser


def _secrets(args: argparse.Namespace) -> int:
    from cacheflow_common.auth import ensure_cluster_secrets

    print(ensure_cluster_secrets(Path(args.dir).expanduser()))
    return 0


def _up(args: argparse.Namespace) -> int:
    return up.run(args, default_cache_dir())


def _demo(args: argparse.Namespace) -> int:
    return demo_run.run(args, default_cache_dir())


SERVICES = {"demo": _demo, "storage": _storage, "worker": _worker, "coordinator": _coordinator, "up": _up,
            "operator": _operator, "secrets": _secrets}
LONG_RUNNING = ("storage", "worker", "coordinator", "operator")  # their logs are files worth reading: INFO


def configure_logging(command: str, verbose: bool) -> None:
    """INFO for the services (their log files say what they serve), WARNING for the commands a person
    watches (no library's INFO lines between the progress lines); DEBUG with -v."""
    level = logging.DEBUG if verbose else logging.INFO if command in LONG_RUNNING else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))  # one line per HTTP call otherwise


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.command, args.verbose)
    try:
        if getattr(args, "model", None) is not None:  # a wrong model name is refused before any work
            check_model(args.model)
        if args.command == "profile":
            return _profile(args)
        if args.command == "bench":
            return _bench(args)
        return SERVICES[args.command](args)
    except CacheFlowError as exc:
        print(f"cacheflow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
