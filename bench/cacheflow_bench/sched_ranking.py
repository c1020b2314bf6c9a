"""Which request should a storage channel serve? Algorithm 1's ranking (largest remaining recomputation
first) against Cake's (first come, first served) and three others (least remaining recomputation
first, `cacheflow`'s default; the largest share of its own work done first; the highest response
ratio, (waited + remaining) / remaining), in the simulator.

    python -m cacheflow_bench.sched_ranking

Simulated only, with a synthetic cost model so that the question is not this CPU's: a Llama-8B-shaped
model (32 layers, 4 KiB of KV per token and layer), 4 stages, 4 channels balanced for a 4096-token
prefix (Tio/Tcomp = 1), token-wise restores, batch cap 8. The part of a chunk's compute cost that a
batch pays once (`fixed share`) goes from 0 (a CPU: batched compute costs the sum of its parts) to 0.9
(a GPU: a batch costs little more than one chunk). The trace is the demo's Mooncake slice, replayed
at three arrival scales. Writes bench/results/sched_ranking.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheflow_bench.common import RESULTS_DIR, markdown_table, provenance, write_json
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.sim import ModelShape, SimConfig, simulate
from cacheflow_common.sim.config import balanced_link_gbps
from cacheflow_common.sim.replay import load_slice, select_requests
from cacheflow_common.sim.trace import TraceRequest
from cacheflow_services.demo.run import SLICE

SHAPE = ModelShape(num_layers=32, kv_bytes_per_token_layer=4096)
STAGES, CHUNK, BATCH = 4, 256, 8
CHUNK_LAYER_S = 2e-3  # one layer over one 256-token chunk at the start of the prefix
POLICIES = ("compute-only", "cake", "cacheflow-alg1", "cacheflow-srpt", "cacheflow-progress", "cacheflow-hrrn")
RANKINGS = {"cake": "first come", "cacheflow-alg1": "Algorithm 1", "cacheflow-srpt": "least remaining",
            "cacheflow-progress": "most done", "cacheflow-hrrn": "response ratio"}  # channel rankings, by policy


def costs_with(fixed_share: float) -> CostModel:
    """A chunk's per-layer cost, `fixed_share` of it paid once per batch; attention grows with context."""
    variable = CHUNK_LAYER_S * (1 - fixed_share) / CHUNK
    chunk = LinearCost(fixed_s=CHUNK_LAYER_S * fixed_share, per_token_s=0.7 * variable,
                       per_token_ctx_s=0.3 * variable / 2048)
    return CostModel(chunk_compute=chunk, layer_compute=chunk, load=LoadCost(bytes_per_s=1e12, latency_s=1e-4))


def ttfts(trace: list[TraceRequest], fixed_share: float) -> dict[str, tuple[float, float]]:
    """Per policy: (mean, P99) simulated TTFT in seconds."""
    costs = costs_with(fixed_share)
    link = balanced_link_gbps(costs, SHAPE, n_stages=STAGES, n_channels=STAGES, tokens=4096)
    out = {}
    for policy in POLICIES:
        config = SimConfig(model=SHAPE, costs=costs, policy=policy, n_stages=STAGES, n_channels=STAGES,
                           link_gbps=link, chunk_size=CHUNK, l_delta=0, max_batch=BATCH)
        summary = simulate(trace, config).summary()
        out[policy] = (summary["ttft_mean_s"], summary["ttft_p99_s"])
    return out


def run(arrival_scales: Sequence[float], fixed_shares: Sequence[float]) -> list[dict[str, Any]]:
    rows = []
    for scale in arrival_scales:
        trace = [r.trace for r in select_requests(load_slice(SLICE), count=100, token_scale=1,
                                                  max_tokens=32768, time_scale=scale)]
        for share in fixed_shares:
            result = ttfts(trace, share)
            rows.append({"arrival_scale": scale, "fixed_share": share, "requests": len(trace),
                         **{f"{p}_{k}": result[p][i] for p in POLICIES for i, k in enumerate(("mean_s", "p99_s"))}})
    return rows


def report(body: dict[str, Any]) -> str:
    header = ["arrival scale", "fixed share", "compute-only mean (s)", "first come mean / P99 (s)",
              *[f"{RANKINGS[p]} / first come, mean / P99" for p in RANKINGS if p != "cake"]]
    rows = [[r["arrival_scale"], r["fixed_share"], r["compute-only_mean_s"],
             f"{r['cake_mean_s']:.3f} / {r['cake_p99_s']:.3f}",
             *[f"{r[f'{p}_mean_s'] / r['cake_mean_s']:.2f} / {r[f'{p}_p99_s'] / r['cake_p99_s']:.2f}"
               for p in RANKINGS if p != "cake"]] for r in body["rows"]]
    s = body["summary"]
    better = "; ".join(f"{RANKINGS[p]} {s['better_cells'][p]}" for p in RANKINGS if p != "cake")
    return (f"# Channel ranking: Algorithm 1 (largest remaining recomputation first) vs first come and others\n\n"
            f"Simulated. Command: `{body['command']}`. {' '.join(__doc__.split(chr(10) + chr(10))[2].split())}\n\n"
            f"{markdown_table(header, rows)}\n\nCells (of {s['cells']}) where a ranking's mean TTFT beats first "
            f"come, first served (Cake's): {better}.\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cacheflow_bench.sched_ranking",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    rows = run((1.0, 0.2, 0.05), (0.0, 0.5, 0.9))
    better = {p: sum(r[f"{p}_mean_s"] < r["cake_mean_s"] for r in rows) for p in RANKINGS if p != "cake"}
    summary = {"cells": len(rows), "alg1_better_cells": better["cacheflow-alg1"], "better_cells": better}
    body = {**provenance(False), "summary": summary, "rows": rows}
    out = Path(args.out)
    write_json(out / "sched_ranking.json", body)
    (out / "sched_ranking.md").write_text(report(body))
    print(report(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
