"""The batch scheduler at production batch sizes: what one decision costs as the batch grows, whether the
decisions stay the same, and what the scheduler costs the simulator and the engine.

    cacheflow bench sched-scale                         # the full run: bench/results/sched_scale.{json,md,png}
    cacheflow bench sched-scale --quick                 # a smoke run (a minute), into bench/results/tmp
    cacheflow bench sched-scale --baseline before.json  # also side by side with a run of other code

1. Decision cost: the wall time (and the CPU time) of each compute pick (`next_compute_batch`) and
   channel pick (`next_load`) of one stage's scheduler at 1 to 1,024 concurrent restores of 16 and 64 units, for
   `cacheflow`, `cacheflow-srpt` and `cake`, in a closed loop with GPU-like unit costs
   (`sched_scale_drive`): median, P99 and worst per cell, and the exponent k of cost ~ n^k fitted to the
   median compute pick over 8 to 1,024 restores.
2. Decisions: every cell's decisions are fingerprinted (a digest after 1, 2, 4, ... compute picks), and
   so are those of every registered policy on three small cells. Run on the code before a change (the
   module uses only the scheduler's public interface) and passed as `--baseline`, the two runs'
   fingerprints are compared at the most compute picks both made: `decisions_identical`.
3. The simulator's wall time for 10,000 requests of the Mooncake trace (`cacheflow` policy, GPU-like costs).
4. The engine's steps at 128 concurrent restores on the tiny model, its loop on its own thread (a
   worker's) and on the caller's (the connector's): the scheduler's share of the loop's time in steps
   (`sched_scale_engine`).

Timings are wall times on this machine's CPU, not a GPU's: the scheduler is pure Python either way.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import cacheflow_common.sched
from cacheflow_bench.common import TRACE, add_out_option, provenance, results_dir, write_json
from cacheflow_bench.sched_scale_drive import (
    CHUNK,
    KV_BYTES_PER_TOKEN_LAYER,
    LINK_BYTES_PER_S,
    N_CHANNELS,
    STAGE_LAYERS,
    STEP_TOKENS,
    drive,
)
from cacheflow_bench.sched_scale_engine import step_share
from cacheflow_bench.sched_scale_report import compare, plot, report, summarize
from cacheflow_common.sched import POLICIES
from cacheflow_common.sim import ModelShape, SimConfig, read_trace, simulate

POLICIES_TIMED = ("cacheflow", "cacheflow-srpt", "cake")
SIZES = (1, 8, 32, 128, 512, 1024)  # concurrent restores
UNITS = (16, 64)
FINGERPRINT_CELLS = ((8, 16), (32, 16), (32, 64))  # (restores, units): every registered policy, untimed
SIM_REQUESTS = 10_000
ENGINE_RESTORES = 128


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench sched-scale", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: small cells, few picks, a short trace")
    p.add_argument("--picks", type=int, default=300, help="compute picks per cell (default 300; --quick 20)")
    p.add_argument("--cell-budget-s", type=float, default=60.0,
                   help="wall time after which a cell stops picking (only slow code reaches it; default 60)")
    p.add_argument("--baseline", default="", help="a sched_scale.json of other code to compare with")
    p.add_argument("--label", default="", help="what the code under test is, e.g. 'before' (default: its git)")
    add_out_option(p)
    return p.parse_args(list(argv))


def scheduler_code() -> dict[str, str]:
    """Which scheduler ran: where it was imported from and a digest of its sources."""
    folder = Path(cacheflow_common.sched.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return {"path": str(folder), "sha256": digest.hexdigest()[:16]}


def percentile(xs: list[int], q: float) -> float:
    """The q-quantile of `xs` (nearest rank), in milliseconds."""
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


def cell(policy: str, restores: int, units: int, picks: int, budget_s: float, checkpoints: set[int]
         ) -> dict[str, Any]:
    gc.collect()
    run = drive(policy, restores, units, picks=picks, budget_s=budget_s, checkpoints=checkpoints)
    row: dict[str, Any] = {"policy": policy, "restores": restores, "units": units,
                           "compute_picks": len(run.compute_ns), "channel_picks": len(run.channel_ns),
                           "finished": run.finished, "stopped_by_budget": run.stopped_by_budget,
                           "digests": {str(k): v for k, v in run.digests.items()}}
    for name, samples in (("compute", run.compute_ns), ("channel", run.channel_ns),
                          ("compute_cpu", run.compute_cpu_ns), ("channel_cpu", run.channel_cpu_ns)):
        row[f"{name}_ms"] = {"median": percentile(samples, 0.5), "p99": percentile(samples, 0.99),
                             "worst": max(samples) / 1e6}
    return row


def _picks_made(baseline: dict[str, Any] | None, part: str) -> dict[tuple[str, int, int], set[int]]:
    """How many compute picks each of the baseline's cells made: the fingerprints compare there."""
    rows = baseline[part] if baseline else []
    return {(r["policy"], r["restores"], r["units"]): {max(map(int, r["digests"]))} for r in rows}


def decision_cells(args: argparse.Namespace, baseline: dict[str, Any] | None) -> list[dict[str, Any]]:
    sizes = (1, 8, 32) if args.quick else SIZES
    units = (16,) if args.quick else UNITS
    made = _picks_made(baseline, "cells")
    rows = []
    for policy in POLICIES_TIMED:
        for n in sizes:
            for u in units:
                row = cell(policy, n, u, args.picks, args.cell_budget_s, made.get((policy, n, u), set()))
                rows.append(row)
                print(f"{policy:15s} {n:5d} x {u:2d}: compute pick median {row['compute_ms']['median']:.3f} ms, "
                      f"P99 {row['compute_ms']['p99']:.3f}, worst {row['compute_ms']['worst']:.3f}; channel pick "
                      f"median {row['channel_ms']['median']:.3f} ms ({row['compute_picks']} picks)", flush=True)
    return rows


def fingerprints(args: argparse.Namespace, baseline: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Every registered policy's decisions on the fingerprint cells (not timed)."""
    cells = FINGERPRINT_CELLS[:1] if args.quick else FINGERPRINT_CELLS
    made = _picks_made(baseline, "fingerprints")
    rows = []
    for policy in sorted(POLICIES):
        for n, u in cells:
            run = drive(policy, n, u, picks=args.picks, checkpoints=made.get((policy, n, u), set()))
            rows.append({"policy": policy, "restores": n, "units": u,
                         "digests": {str(k): v for k, v in run.digests.items()}})
    return rows


def sim_wall(requests: int) -> dict[str, Any]:
    """The simulator's wall time over `requests` of the Mooncake trace; and a digest of what it predicted."""
    from cacheflow_bench.sched_scale_drive import GPU_COSTS

    trace = read_trace(TRACE, count=requests)
    config = SimConfig(model=ModelShape(num_layers=4 * STAGE_LAYERS, kv_bytes_per_token_layer=KV_BYTES_PER_TOKEN_LAYER),
                       costs=GPU_COSTS, policy="cacheflow", n_stages=4, n_channels=4,
                       link_gbps=LINK_BYTES_PER_S * 8 / 1e9, chunk_size=CHUNK, max_batch_tokens=STEP_TOKENS)
    gc.collect()
    started = time.perf_counter()
    result = simulate(trace, config)
    wall = time.perf_counter() - started
    predicted = json.dumps([(r.request_id, r.restore_s, r.ttft_s) for r in result.requests]).encode()
    return {"requests": len(trace), "wall_s": wall, "max_batch": config.max_batch,
            "ttft_mean_s": result.summary()["ttft_mean_s"], "digest": hashlib.sha256(predicted).hexdigest()[:16]}


def engine_rows(quick: bool) -> list[dict[str, Any]]:
    restores = 8 if quick else ENGINE_RESTORES
    rows = []
    for loop_thread in (True, False):
        for policy in POLICIES_TIMED:
            row = step_share(policy, restores, loop_thread=loop_thread)
            rows.append(row)
            print(f"engine, {row['mode']}, {policy}: {row['steps']} steps, median {row['step_ms_median']:.1f} ms; "
                  f"scheduler share {100 * row['sched_share']:.2f} %", flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.quick and args.picks == 300:
        args.picks = 20
    out = results_dir(args)
    body: dict[str, Any] = {**provenance(args.quick), "label": args.label, "scheduler_code": scheduler_code(),
                            "setup": {"step_tokens": STEP_TOKENS, "channels": N_CHANNELS, "chunk_tokens": CHUNK,
                                      "stage_layers": STAGE_LAYERS, "link_gbps": LINK_BYTES_PER_S * 8 / 1e9,
                                      "picks_per_cell": args.picks, "cell_budget_s": args.cell_budget_s}}
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    body["cells"] = decision_cells(args, baseline)
    body["fingerprints"] = fingerprints(args, baseline)
    body["sim"] = sim_wall(300 if args.quick else SIM_REQUESTS)
    print(f"simulator: {body['sim']['requests']} requests in {body['sim']['wall_s']:.1f} s", flush=True)
    body["engine"] = engine_rows(args.quick)
    if baseline is not None:
        body["baseline"] = {k: baseline[k] for k in ("label", "scheduler_code", "machine", "command", "cells",
                                                     "fingerprints", "sim", "engine", "summary")}
        body["comparison"] = compare(body, baseline)
    body["summary"] = summarize(body)
    write_json(out / "sched_scale.json", body)
    (out / "sched_scale.md").write_text(report(body))
    plot(out / "sched_scale.png", body)
    print(json.dumps(body["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
