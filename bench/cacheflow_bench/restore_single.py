"""Single-request restore: every policy side by side, at its strongest, against the optimal bound.

For each model, prefix length N and emulated link speed (chosen so that Tio/Tcomp takes the listed
ratios), it runs compute-only, load-only, Cake, CacheFlow token-wise, layer-wise and adaptive in one
process, interleaved, median of --repeats; every repeat also measures the unit costs T* comes from
(`restore_runs.py` says how each baseline and T* are made), so T*'s own run-to-run spread is known.
Every run's KV is checked against the full prefill. Writes bench/results/restore_single.{json,md,png}.

    python -m cacheflow_bench.restore_single            # the published grid (about 20 minutes on 2 cores)
    python -m cacheflow_bench.restore_single --quick    # a smoke run (tiny model, seconds)
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cacheflow_bench import restore_runs as runs
from cacheflow_bench.common import add_out_option, median, provenance, results_dir, write_json
from cacheflow_bench.restore_single_report import POLICIES, plot, render_markdown, summarize
from cacheflow_common.engine import ProfileSettings, profile_model, restore
from cacheflow_common.model.sources import check_model, default_device, load_model, parse_dtype
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.profile import Profile
from cacheflow_common.restore.save import make_job, save_prefix
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.store.filesystem import FilesystemStore
from cacheflow_common.store.shaped import ShapedStore
from cacheflow_common.transport.shaping import TokenBucket

TIMED = ("cake", "cacheflow-token", "cacheflow-layer", "cacheflow")  # the policies restore() runs


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench restore", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,smollm2", help="comma list of tiny | smollm2 | model dirs")
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="prefix lengths in tokens")
    p.add_argument("--ratios", default="0.25,0.5,1,2,4", help="Tio/Tcomp ratios that set the link speed")
    p.add_argument("--cap", default="", help="per-model longest prefix, e.g. smollm2=4096 (to fit a time budget)")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="runs per policy and cell (median)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (set explicitly: timings depend on it)")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on AMX CPUs and GPUs, else float32")
    p.add_argument("--device", default="auto", help="auto (cuda when there is a GPU) | cpu | cuda")
    p.add_argument("--links-gbps", default="", help="fixed link speeds in Gbit/s instead of --ratios, e.g. 10,40,80")
    p.add_argument("--stem", default="restore_single", help="result file names: STEM.json, STEM.md, STEM.png")
    add_out_option(p)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny model, short prefixes, one repeat")
    args = p.parse_args(argv)
    if args.quick:  # smoke settings, for whatever was not given explicitly
        quick = {"models": "tiny", "lengths": "512,1024", "ratios": "0.5,1,2", "repeats": 1}
        for name, value in quick.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(argv) if argv is not None else __import__("sys").argv[1:])
    for name in args.models.split(","):  # every model checked before the first one is measured
        check_model(name)
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    ratios = [float(x) for x in args.ratios.split(",")]
    cells: list[dict[str, Any]] = []
    profiles: dict[str, Any] = {}
    out = results_dir(args)
    with tempfile.TemporaryDirectory(prefix="cacheflow-bench-") as tmp:
        for name in args.models.split(","):
            device = default_device() if args.device == "auto" else args.device
            model = load_model(name, dtype=parse_dtype(args.dtype), device=device)
            profile = _profile(model, name, args, max(lengths))
            profiles[name] = profile.to_json()
            store = FilesystemStore(Path(tmp) / name)
            cap = dict(item.split("=") for item in args.cap.split(",") if item).get(name)
            for n in [x for x in lengths if cap is None or x <= int(cap)]:
                print(f"[{name}] N={n}", flush=True)
                cells += _bench_length(model, name, profile, store, n, ratios, args)
                _write(out, args, profiles, cells)  # partial results survive an interrupted run
    body = _write(out, args, profiles, cells)
    plot(cells, out / f"{args.stem}.png")
    print(render_markdown(body))
    return 0


def _write(out: Path, args: argparse.Namespace, profiles: dict[str, Any],
           cells: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"summary": summarize(cells), **provenance(args.quick),
            "settings": {k: v for k, v in vars(args).items() if k != "out"}, "profiles": profiles, "cells": cells}
    write_json(out / f"{args.stem}.json", body)
    (out / f"{args.stem}.md").write_text(render_markdown(body))
    return body


def _profile(model: Transformer, name: str, args: argparse.Namespace, max_tokens: int) -> Profile:
    from cacheflow_common.store.memory import MemoryStore

    settings = ProfileSettings(chunk_size=args.chunk_size, max_tokens=min(max_tokens, 4096), repeats=2)
    print(f"[{name}] profiling", flush=True)
    return profile_model(model, store=MemoryStore(), settings=settings, model_name=name)


def _bench_length(model: Transformer, name: str, profile: Profile, store: ChunkStore, n: int,
                  ratios: Sequence[float], args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(n)
    job = make_job(model, [rng.randrange(model.config.vocab_size) for _ in range(n)], tenant="bench",
                   chunk_size=args.chunk_size)
    reference = save_prefix(model, job, store).data[:, :, :, :n]  # [L, 2, Hkv, N, D]: the full prefill
    for mode, units in (("token", len(job.keys)), ("layer", len(job.layers))):
        runs.forced(model, job, store, mode, units)  # warm-up, discarded: first runs of a new length are slower
    chunk, chunk_times = runs.fastest_chunking(model, job, args.chunk_size)
    # The operating point: the link speed that makes loading the prefix take `ratio` x its recompute.
    t_comp = chunk_times[args.chunk_size]
    kv_bytes = n * len(job.layers) * model.kv_bytes_per_token_per_layer
    length = Length(model, name, profile, store, job, reference, chunk, chunk_times)
    cells = []
    for ratio, rate in _links(kv_bytes, t_comp, ratios, args.links_gbps):
        cells.append(_bench_cell(length, ratio, rate, args.repeats))
        c = cells[-1]
        times = ", ".join(f"{p}={c['times_s'][p]:.3f}" for p in POLICIES)
        print(f"  Tio/Tcomp={ratio:.3g} ({rate * 8 / 1e9:.3g} Gbit/s): {times}, bound={c['bound_s']:.3f} "
              f"(spread {c['bound_spread']:.2f})", flush=True)
    return cells


def _links(kv_bytes: int, t_comp: float, ratios: Sequence[float], links_gbps: str) -> list[tuple[float, float]]:
    """(Tio/Tcomp, link bytes/s) per cell: fixed link speeds if given, else the speeds that give `ratios`."""
    if links_gbps:
        rates = [float(x) * 1e9 / 8 for x in links_gbps.split(",")]
        return [(kv_bytes / (rate * t_comp), rate) for rate in rates]
    return [(ratio, kv_bytes / (ratio * t_comp)) for ratio in ratios]


@dataclass(frozen=True)
class Length:
    """One prefix length's fixed parts: the model, its saved chunks, the full prefill's KV, the best chunking."""

    model: Transformer
    name: str
    profile: Profile
    store: ChunkStore
    job: RestoreJob
    reference: torch.Tensor  # [L, 2, Hkv, N, D]
    compute_chunk: int
    chunk_times: dict[int, float]


class Repeats:
    """Every measured run of one cell: times per policy, the per-repeat bound, KV checks, unit sources."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {p: [] for p in (*POLICIES, "load-only-token", "load-only-layer")}
        self.bounds: list[float] = []
        self.kv_errors: dict[str, dict[str, float]] = {}
        self.units: dict[str, dict[str, Any]] = {}

    def record(self, policy: str, elapsed: float, kv: torch.Tensor, sources: Sequence[str], mode: str,
               length: Length, bytes_loaded: int) -> None:
        self.times[policy].append(elapsed)
        errors = runs.kv_errors(kv, length.reference, sources, mode, length.job)
        seen = self.kv_errors.setdefault(policy, {"loaded": 0.0, "computed": 0.0})
        self.kv_errors[policy] = {k: max(seen[k], v) for k, v in errors.items()}
        self.units[policy] = {"mode": mode, "computed": [i for i, s in enumerate(sources) if s == "computed"],
                              "loaded": sum(s == "loaded" for s in sources), "bytes_loaded": bytes_loaded}


def _bench_cell(length: Length, ratio: float, rate: float, repeats: int) -> dict[str, Any]:
    model, job, raw = length.model, length.job, length.store

    def linked() -> ShapedStore:
        return ShapedStore(raw, TokenBucket(rate))

    costs, l_delta = length.profile.cost_model(rate), length.profile.l_delta_for(rate)
    n = len(job.token_ids)
    rec = Repeats()
    for _ in range(repeats):  # interleaved: drift on a shared machine hits every policy, and T*, alike
        gc.collect()  # a collection inside a timed run would be charged to that run
        by_token = runs.forced(model, job, raw, "token", len(job.keys))  # unit costs for the bound
        same = length.compute_chunk == job.keys[0].token_end  # the fastest chunking is the restore's own
        best = by_token if same else runs.compute_only(model, job, length.compute_chunk)
        rec.record("compute-only", best.elapsed_s, best.kv.data[:, :, :, :n], best.sources(), "token", length, 0)
        by_layer = runs.forced(model, job, raw, "layer", len(job.layers))
        loads = {mode: runs.pipelined_load(model, job, linked(), mode) for mode in ("token", "layer")}
        for mode, load in loads.items():
            rec.record(f"load-only-{mode}", load.elapsed_s, load.kv, ["loaded"] * len(load.unit_costs), mode,
                       length, load.bytes_loaded)
        rec.bounds.append(min(runs.split_bound(runs.unit_costs(by_token), loads["token"].unit_costs),
                              runs.split_bound(runs.unit_costs(by_layer), loads["layer"].unit_costs),
                              best.elapsed_s))
        for policy in TIMED:
            gc.collect()
            result = restore(job, model=model, store=linked(), policy=policy, costs=costs, l_delta=l_delta)
            runs.require_complete(result)
            rec.record(policy, result.elapsed_s, result.kv.data[:, :, :, :n], result.sources(), result.mode, length,
                       result.bytes_loaded)
    return _cell(length, ratio, rate, l_delta, rec)


def _cell(length: Length, ratio: float, rate: float, l_delta: int, rec: Repeats) -> dict[str, Any]:
    order = min(("token", "layer"), key=lambda m: median(rec.times[f"load-only-{m}"]))
    rec.times["load-only"] = rec.times[f"load-only-{order}"]
    rec.kv_errors["load-only"], rec.units["load-only"] = rec.kv_errors[f"load-only-{order}"], rec.units[
        f"load-only-{order}"]
    times = {p: median(rec.times[p]) for p in POLICIES}
    bound = median(rec.bounds)
    return {
        "model": length.name, "n_tokens": len(length.job.token_ids), "ratio": ratio, "link_gbps": rate * 8 / 1e9,
        "link": {"emulated": True, "gbps": rate * 8 / 1e9,
                 "chosen": f"token bucket set so that loading the prefix takes {ratio:g}x its recompute "
                           f"in {length.job.keys[0].token_end}-token chunks"},
        "l_delta": l_delta, "adaptive_mode": rec.units["cacheflow"]["mode"], "times_s": times,
        "runs_s": {p: rec.times[p] for p in POLICIES},
        "baselines": {"compute_only_chunk": length.compute_chunk, "compute_only_chunk_times_s": length.chunk_times,
                      "load_only_order": order, "load_only_reads_in_flight": runs.LOAD_ONLY_READS_IN_FLIGHT},
        "bound_s": bound, "bound_runs_s": rec.bounds, "bound_spread": (max(rec.bounds) - min(rec.bounds)) / bound,
        "ratio_to_bound": {p: t / bound for p, t in times.items()},
        "kv_max_rel_error": {p: rec.kv_errors[p] for p in POLICIES}, "units": {p: rec.units[p] for p in POLICIES},
        "load_average": os.getloadavg()[0],
    }




if __name__ == "__main__":
    raise SystemExit(main())
