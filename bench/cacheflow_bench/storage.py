"""Storage data-plane benchmark: shaped-rate accuracy, raw TCP vs NIXL throughput, small-read latency.

Real pods (`cacheflow storage`, memory backend so the transport is what is measured) on loopback,
read by real clients in this process:

* shaping: 1 and several concurrent readers against pods shaped to each rate; the achieved aggregate
  rate vs the configured one (and each reader's share, for fairness);
* raw: one reader, unshaped, chunk objects of 1-64 MB: GB/s per transport;
* latency: median time of a 4 KiB read, the per-chunk fixed cost for the scheduler's cost model.

Writes bench/results/storage.{json,md,png}; the JSON's `summary` holds max_shaping_error, nixl_gbps
and tcp_gbps (raw, largest chunk).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
from cacheflow_common.kv.chunk import encode_kv_chunk
from cacheflow_common.kv.keys import chunk_keys, object_name, tenant_salt
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.transport.shaping import gbps
from cacheflow_services.storage.launch import LocalPod, launch_pod

LAYERS, HEADS, HEAD_DIM = 8, 8, 128  # a chunk of an 8-layer stage of a GQA model: 32 KiB of fp32 KV per token
LATENCY_BYTES = 4096
LATENCY_READS = 300


SUSTAINABLE_SHARE = 0.5  # a shaped rate counts as one the host sustains up to half its raw rate


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench storage", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.5,2,8", help="shaped link rates, Gbit/s (ones this host can sustain)")
    p.add_argument("--readers", default="1,4", help="concurrent reader counts for the shaping runs")
    p.add_argument("--sizes", default="1,4,16,64", help="raw-throughput chunk sizes, MB")
    p.add_argument("--seconds", type=float, default=3.0, help="duration of each shaped run")
    p.add_argument("--transports", default="tcp,nixl", help="tcp and/or nixl (nixl is skipped if unavailable)")
    add_out_option(p)
    p.add_argument("--quick", action="store_true", help="smoke run: one rate, small sizes, short runs")
    args = p.parse_args(argv)
    if args.quick:
        args.rates, args.readers, args.sizes, args.seconds = "1", "1,2", "1,4", 0.6
    return args


def make_chunk(megabytes: float, seed: int) -> tuple[str, bytes]:
    """A real kv chunk object of about `megabytes` MB (pods accept only valid chunks)."""
    tokens = max(1, int(megabytes * 1e6 / (LAYERS * 2 * HEADS * HEAD_DIM * 4)))
    ids = [(seed * 1000 + i) % 32000 for i in range(tokens)]
    key = chunk_keys(ids, tokens, tenant_salt("bench", "alpha"))[0]
    kv = torch.randn(LAYERS, 2, HEADS, tokens, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    obj = encode_kv_chunk(key=key, token_ids=ids, model="bench", layer_start=0, kv=kv, dtype="float32")
    return object_name(key, "kv", 0, LAYERS), obj


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
            name, obj = make_chunk(max(1.0, rate_gbps / 8 * 1e3 * 0.05), seed=1)  # ~50 ms per read at this rate
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


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    transports = [t for t in args.transports.split(",") if available(t)]
    shaped: list[dict[str, Any]] = []
    raws: list[dict[str, Any]] = []
    latency: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for transport in transports:
            print(f"[{transport}]", flush=True)
            rows, latency[transport] = raw(args, Path(tmp), transport)
            raws += rows
            sustained = max(r["gbps"] for r in rows)
            shaped += [dict(row, sustainable=row["rate_gbps"] <= SUSTAINABLE_SHARE * sustained)
                       for row in shaping(args, Path(tmp), transport)]
    largest = {t: max((r for r in raws if r["transport"] == t), key=lambda r: r["chunk_mb"]) for t in transports}
    summary = {
        "max_shaping_error": max((r["error"] for r in shaped if r["sustainable"]), default=None),
        "max_shaping_error_all_rates": max(r["error"] for r in shaped),
        "nixl_gbps": largest["nixl"]["gbps"] if "nixl" in largest else None,
        "tcp_gbps": largest["tcp"]["gbps"] if "tcp" in largest else None,
        "small_read_latency_s": latency,
        "min_reader_share": min(r["min_share"] for r in shaped),
    }
    out = results_dir(args)
    link = {"emulated": True, "chosen": "the configured --rates, each pod's token bucket; raw runs unshaped loopback"}
    write_json(out / "storage.json", {"summary": summary, **provenance(args.quick), "link": link, "shaping": shaped,
                                      "raw": raws})
    _write_markdown(out / "storage.md", summary, shaped, raws)
    _plot(out / "storage.png", shaped, raws)
    print(f"max shaping error {summary['max_shaping_error']} (sustainable rates); "
          f"raw tcp {summary['tcp_gbps']} Gbit/s, "
          f"nixl {summary['nixl_gbps']} Gbit/s")
    return 0


def _write_markdown(path: Path, summary: dict[str, Any], shaped: list[dict[str, Any]],
                    raws: list[dict[str, Any]]) -> None:
    facts = machine_facts()
    lines = ["# Storage data plane", "",
             f"Machine: {facts['cpu']}, {facts['cpus']} CPUs; git {facts['git']}. Command: `{command_line()}`.", "",
             "Shaped rates are emulated links: each pod's token bucket, at the configured rates (`--rates`: ones "
             "this host sustains, up to half its raw rate, count towards the target); raw rates are loopback, "
             "unshaped. No real network link is measured here.", "",
             markdown_table(["target", "measured", "goal"], [
                 [f"worst shaped-rate error, rates <= {SUSTAINABLE_SHARE} x raw", summary["max_shaping_error"],
                  "<= 0.05"],
                 ["worst shaped-rate error, all rates", summary["max_shaping_error_all_rates"], ""],
                 ["raw TCP, largest chunk (Gbit/s)", summary["tcp_gbps"] or "-", ""],
                 ["raw NIXL, largest chunk (Gbit/s)", summary["nixl_gbps"] or "-", ""],
             ]), "",
             "Small (4 KiB) read latency: " + ", ".join(f"{t} {v * 1e6:.0f} us"
                                                        for t, v in summary["small_read_latency_s"].items()), "",
             markdown_table(["transport", "readers", "configured Gbit/s", "achieved Gbit/s", "error", "min share",
                             "sustainable"],
                            [[r["transport"], r["readers"], r["rate_gbps"], r["achieved_gbps"], r["error"],
                              r["min_share"], "yes" if r["sustainable"] else "no"] for r in shaped]), "",
             markdown_table(["transport", "chunk MB", "GB/s", "Gbit/s"],
                            [[r["transport"], r["chunk_mb"], r["gbytes_per_s"], r["gbps"]] for r in raws]), ""]
    path.write_text("\n".join(lines))


def _plot(path: Path, shaped: list[dict[str, Any]], raws: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for t in sorted({r["transport"] for r in raws}):
        rows = [r for r in raws if r["transport"] == t]
        a.plot([r["chunk_mb"] for r in rows], [r["gbytes_per_s"] for r in rows], marker="o", label=t)
        rows = [r for r in shaped if r["transport"] == t]
        b.scatter([r["rate_gbps"] for r in rows], [r["achieved_gbps"] for r in rows], label=t)
    top = max((r["rate_gbps"] for r in shaped), default=1.0)
    b.plot([0, top], [0, top], "k--", linewidth=0.8, label="configured")
    a.set(xscale="log", xlabel="chunk MB", ylabel="GB/s", title="raw read throughput")
    b.set(xlabel="configured Gbit/s", ylabel="achieved Gbit/s", title="shaped aggregate rate")
    a.legend()
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
