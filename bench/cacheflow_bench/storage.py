"""Storage data-plane benchmark: what a load costs, shaped-rate accuracy, TCP vs NIXL, an idle pod's CPU.

Real pods (`cacheflow storage`, memory backend so the transport is what is measured) on loopback,
read by real clients in this process:

* raw: one reader, unshaped, chunk objects of 1-64 MB into a plain buffer: GB/s per transport;
* loads: a restore's loader (`KVLoader`) reading the same sizes into a KV buffer, checked and landed:
  GB/s, and CPU seconds per GB in the pod and in the loader (`storage_loads`); then the pod idle;
* shaping: 1 and several concurrent readers against pods shaped to each rate; the achieved aggregate
  rate vs the configured one (and each reader's share, for fairness);
* latency: median time of a 4 KiB read, the per-chunk fixed cost for the scheduler's cost model;
* yardsticks: a memcpy's CPU per GB, and plain loopback TCP with no CacheFlow code (the ceiling).

Writes bench/results/storage.{json,md,png}; the JSON's `summary` holds the targets' keys
(`loader_gb_per_s_tcp`, `nixl_vs_tcp_throughput_min`, `cpu_s_per_gb_end_to_end_max` against
`memcpy_cpu_s_per_gb`, `max_shaping_error`, `idle_pod_cpu_share_max`) and the raw rates.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheflow_bench.common import add_out_option, median, provenance, results_dir, write_json
from cacheflow_bench.storage_loads import loader_run, make_kv_chunk, memcpy_cpu_s_per_gb, socket_ceiling
from cacheflow_bench.storage_report import plot, write_markdown
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.transport.shaping import gbps
from cacheflow_services.local_process import idle_cpu_share
from cacheflow_services.storage.launch import LocalPod, launch_pod

LATENCY_BYTES = 4096
LATENCY_READS = 300


SHAPED_MB_MAX = 64.0  # a shaped run's object at most (at 40 Gbit/s, 50 ms would be a 250 MB object per reader)
SUSTAINABLE_SHARE = 0.5  # a shaped rate counts as one the host sustains up to half its raw rate


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench storage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1,4,10,40", help="shaped link rates, Gbit/s (those up to half the raw "
                   "rate this host reaches count towards the target)")
    p.add_argument("--readers", default="1,4", help="concurrent reader counts for the shaping runs")
    p.add_argument("--sizes", default="1,4,16,64", help="raw-throughput chunk sizes, MB")
    p.add_argument("--seconds", type=float, default=3.0, help="duration of each shaped run")
    p.add_argument("--transports", default="tcp,nixl", help="tcp and/or nixl (nixl is skipped if unavailable)")
    add_out_option(p)
    p.add_argument("--idle-seconds", type=float, default=5.0, help="how long an idle pod's CPU is measured")
    p.add_argument("--quick", action="store_true", help="smoke run: one rate, small sizes, short runs")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.readers, args.sizes, args.seconds, args.idle_seconds = "1", "1,2", "1,4", 0.6, 1.0
    return args


def make_chunk(megabytes: float, seed: int) -> tuple[str, bytes]:
    """A real kv chunk object of about `megabytes` MB (pods accept only valid chunks): name, bytes."""
    _, name, obj = make_kv_chunk(megabytes, seed)
    return name, obj


def nixl_endpoint(slot_bytes: int) -> Any:
    from cacheflow_common.transport.nixl_plane import NixlClientEndpoint

    return NixlClientEndpoint(slots=8, slot_bytes=slot_bytes)


def read_loop(store: ChunkStore, name: str, size: int, until: float, out: list[int]) -> None:
    """Read `name` whole, again and again, until the monotonic time `until`; append bytes read to `out`."""
    buf = memoryview(bytearray(size))
    done = 0
    while time.monotonic() < until:
        if not store.read_into(name, buf):
            raise RuntimeError(f"benchmark read of {name} missed")
        done += size
    out.append(done)


def shaped_run(pod: LocalPod, clients: list[ChunkStore], name: str, size: int, seconds: float,
               rate: float) -> dict[str, Any]:
    counts: list[int] = []
    start = time.monotonic()
    until = start + seconds
    threads = [threading.Thread(target=read_loop, args=(c, name, size, until, counts)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start  # includes each reader's last read, which ends past `until`
    achieved = sum(counts) / wall
    return {"readers": len(clients), "rate_gbps": rate * 8 / 1e9, "achieved_gbps": achieved * 8 / 1e9,
            "error": abs(achieved - rate) / rate, "min_share": min(counts) / max(counts)}


def shaping(args: argparse.Namespace, work: Path, transport: str) -> list[dict[str, Any]]:
    rows = []
    for rate_gbps in (float(x) for x in args.rates.split(",")):
        pod = launch_pod(work / f"shaped-{transport}-{rate_gbps}", "--rate-gbps", str(rate_gbps),
                         backend="memory", transport=transport)
        try:
            # ~50 ms per read at this rate, within the sizes the raw runs measure
            name, obj = make_chunk(min(SHAPED_MB_MAX, max(1.0, rate_gbps / 8 * 1e3 * 0.05)), seed=1)
            pod.client().put(name, obj)
            for readers in (int(x) for x in args.readers.split(",")):
                nixl = nixl_endpoint(len(obj)) if transport == "nixl" else None
                clients: list[ChunkStore] = [pod.client(nixl=nixl) for _ in range(readers)]
                for c in clients:
                    c.read_into(name, memoryview(bytearray(len(obj))))  # connect and warm up outside the timing
                row = shaped_run(pod, clients, name, len(obj), args.seconds, gbps(rate_gbps))
                rows.append({"transport": transport, **row})
                print(f"  {transport} shaped {rate_gbps} Gbit/s x{readers}: {row['achieved_gbps']:.3f} Gbit/s "
                      f"(error {row['error']:.3f}, min share {row['min_share']:.2f})", flush=True)
        finally:
            pod.stop()
    return rows


def raw(args: argparse.Namespace, work: Path, transport: str) -> tuple[list[dict[str, Any]], float]:
    sizes = [float(x) for x in args.sizes.split(",")]
    pod = launch_pod(work / f"raw-{transport}", "--max-object", "128MiB", backend="memory", transport=transport)
    try:
        nixl = nixl_endpoint(int(max(sizes) * 1.1e6)) if transport == "nixl" else None
        client = pod.client(nixl=nixl)
        rows = []
        for mb in sizes:
            name, obj = make_chunk(mb, seed=int(mb * 10))
            client.put(name, obj)
            buf = memoryview(bytearray(len(obj)))
            client.read_into(name, buf)  # warm-up
            times = []
            for _ in range(max(3, int(200 / mb))):
                t0 = time.perf_counter()
                if not client.read_into(name, buf):
                    raise RuntimeError("raw read missed")
                times.append(time.perf_counter() - t0)
            t = median(times)
            rows.append({"transport": transport, "chunk_mb": len(obj) / 1e6, "seconds": t,
                         "gbps": len(obj) * 8 / t / 1e9, "gbytes_per_s": len(obj) / t / 1e9})
            print(f"  {transport} raw {len(obj) / 1e6:.1f} MB: {rows[-1]['gbytes_per_s']:.2f} GB/s", flush=True)
        small, obj = make_chunk(0.05, seed=99)
        client.put(small, obj)
        buf = memoryview(bytearray(LATENCY_BYTES))
        lat = []
        for _ in range(LATENCY_READS):
            t0 = time.perf_counter()
            client.read_into(small, buf)
            lat.append(time.perf_counter() - t0)
        return rows, median(lat)
    finally:
        pod.stop()


def available(transport: str) -> bool:
    if transport != "nixl":
        return True
    try:
        import cacheflow_common.transport.nixl_plane  # noqa: F401
    except ImportError:
        return False
    return True


def loads(args: argparse.Namespace, work: Path, transport: str) -> tuple[list[dict[str, Any]], float]:
    """A restore's loader against a pod, unshaped, for every size; then the pod's idle CPU share."""
    sizes = [float(x) for x in args.sizes.split(",")]
    pod = launch_pod(work / f"loads-{transport}", "--max-object", "128MiB", backend="memory", transport=transport)
    try:
        client = pod.client(nixl=nixl_endpoint(int(max(sizes) * 1.1e6)) if transport == "nixl" else None)
        rows = []
        for mb in sizes:
            rows.append(loader_run(pod, client, transport, mb, seconds=args.seconds))
            print(f"  {transport} loader {rows[-1]['chunk_mb']:.1f} MB: {rows[-1]['gbytes_per_s']:.2f} GB/s, "
                  f"{rows[-1]['cpu_s_per_gb']:.2f} CPU-s/GB", flush=True)
        assert pod.proc is not None
        (idle,) = idle_cpu_share([pod.proc.pid], args.idle_seconds)
        print(f"  {transport} idle pod: {idle:.3f} of a core", flush=True)
        return rows, idle
    finally:
        pod.stop()


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    transports = [t for t in args.transports.split(",") if available(t)]
    shaped: list[dict[str, Any]] = []
    raws: list[dict[str, Any]] = []
    loaded: list[dict[str, Any]] = []
    latency: dict[str, float] = {}
    idle: dict[str, float] = {}
    yardsticks = {"memcpy_cpu_s_per_gb": memcpy_cpu_s_per_gb(), "socket_ceiling": socket_ceiling()}
    with tempfile.TemporaryDirectory() as tmp:
        for transport in transports:
            print(f"[{transport}]", flush=True)
            rows, latency[transport] = raw(args, Path(tmp), transport)
            raws += rows
            rows, idle[transport] = loads(args, Path(tmp), transport)
            loaded += rows
            sustained = max(r["gbps"] for r in raws if r["transport"] == transport)
            shaped += [dict(row, sustainable=row["rate_gbps"] <= SUSTAINABLE_SHARE * sustained)
                       for row in shaping(args, Path(tmp), transport)]
    summary = summarize(transports, raws, loaded, shaped, latency, idle, yardsticks)
    out = results_dir(args)
    link = {"emulated": True, "chosen": "the configured --rates, each pod's token bucket; raw and loader runs "
                                        "unshaped loopback"}
    write_json(out / "storage.json", {"summary": summary, **provenance(args.quick), "link": link, "shaping": shaped,
                                      "raw": raws, "loads": loaded, "yardsticks": yardsticks})
    write_markdown(out / "storage.md", summary, shaped, raws, loaded)
    plot(out / "storage.png", shaped, raws, loaded)
    print(f"max shaping error {summary['max_shaping_error']} (sustainable rates); loader over TCP "
          f"{summary['loader_gb_per_s_tcp']:.2f} GB/s (worst size), end to end "
          f"{summary['cpu_s_per_gb_end_to_end_max']:.2f} CPU-s/GB (memcpy {summary['memcpy_cpu_s_per_gb']:.2f}); "
          f"idle pod {summary['idle_pod_cpu_share_max']:.3f} of a core")
    return 0


def summarize(transports: list[str], raws: list[dict[str, Any]], loaded: list[dict[str, Any]],
              shaped: list[dict[str, Any]], latency: dict[str, float], idle: dict[str, float],
              yardsticks: dict[str, Any]) -> dict[str, Any]:
    largest = {t: max((r for r in raws if r["transport"] == t), key=lambda r: r["chunk_mb"]) for t in transports}
    speed = {(r["transport"], round(r["chunk_mb"])): r["gbytes_per_s"] for r in loaded}
    ratios = [speed[("nixl", mb)] / tcp for (t, mb), tcp in speed.items() if t == "tcp" and ("nixl", mb) in speed]
    worst_cpu = max(r["cpu_s_per_gb"] for r in loaded)
    return {
        "max_shaping_error": max((r["error"] for r in shaped if r["sustainable"]), default=None),
        "max_shaping_error_all_rates": max(r["error"] for r in shaped),
        "nixl_gbps": largest["nixl"]["gbps"] if "nixl" in largest else None,
        "tcp_gbps": largest["tcp"]["gbps"] if "tcp" in largest else None,
        "small_read_latency_s": latency,
        "min_reader_share": min(r["min_share"] for r in shaped),
        "loader_gb_per_s_tcp": min((r["gbytes_per_s"] for r in loaded if r["transport"] == "tcp"), default=None),
        "loader_gb_per_s_nixl": min((r["gbytes_per_s"] for r in loaded if r["transport"] == "nixl"), default=None),
        "nixl_vs_tcp_throughput_min": min(ratios, default=None),
        "cpu_s_per_gb_end_to_end_max": worst_cpu,
        "loader_cpu_s_per_gb_max": max(r["loader_cpu_s_per_gb"] for r in loaded),
        "memcpy_cpu_s_per_gb": yardsticks["memcpy_cpu_s_per_gb"],
        "cpu_per_gb_over_memcpy_max": worst_cpu / yardsticks["memcpy_cpu_s_per_gb"],
        "socket_ceiling_gb_per_s": yardsticks["socket_ceiling"]["gbytes_per_s"],
        "socket_ceiling_cpu_s_per_gb": yardsticks["socket_ceiling"]["cpu_s_per_gb"],
        "idle_pod_cpu_share_max": max(idle.values()),
        "idle_pod_cpu_share": idle,
    }


if __name__ == "__main__":
    raise SystemExit(main())
