"""Single-request restore: every policy side by side against the optimal two-pointer bound.

For each model, prefix length N and link speed (chosen so that Tio/Tcomp takes the listed ratios),
it runs compute-only, load-only, Cake, CacheFlow token-wise, layer-wise and adaptive in one process
(interleaved, median of --repeats) and computes the bound T* from the measured per-unit costs:
`min over split k of max(compute(units < k), load(units >= k))`, the better of the token and layer
splits. Writes bench/results/restore_single.{json,md,png}.

    python -m cacheflow_bench.restore_single            # the full grid (tens of minutes on 2 cores)
    python -m cacheflow_bench.restore_single --quick    # a smoke run (tiny model, seconds)
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cacheflow_bench.common import (
    add_out_option,
    markdown_table,
    median,
    provenance,
    results_dir,
    write_json,
)
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.sources import default_device, load_model, parse_dtype
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.costs import best_split
from cacheflow_common.restore.executor import RestoreJob, RestoreResult, restore, run_restore
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.restore.planner import FixedSplitPlanner
from cacheflow_common.restore.profile import Profile
from cacheflow_common.restore.profiler import ProfileSettings, profile_model
from cacheflow_common.restore.save import make_job, save_prefix
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.store.filesystem import FilesystemStore
from cacheflow_common.store.shaped import ShapedStore
from cacheflow_common.transport.shaping import TokenBucket

POLICIES = ("compute-only", "load-only", "cake", "cacheflow-token", "cacheflow-layer", "cacheflow")
# Repeated and interleaved in every cell; load-only (bound by the emulated link) runs once per cell.
TIMED = ("compute-only", "cake", "cacheflow-token", "cacheflow-layer", "cacheflow")


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
    _plot(cells, out / f"{args.stem}.png")
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
    save_prefix(model, job, store)
    for mode, units in (("token", len(job.keys)), ("layer", len(job.layers))):
        _forced(model, job, store, mode, units)  # warm-up, discarded: first runs of a new length are slower
    # Layer-wise compute-only is needed only for the layer-split bound: once per length.
    comp_layer = [_forced(model, job, store, "layer", len(job.layers)) for _ in range(args.repeats)]
    t_comp = median([_forced(model, job, store, "token", len(job.keys)).elapsed_s for _ in range(args.repeats)])
    kv_bytes = n * len(job.layers) * model.kv_bytes_per_token_per_layer
    cells = []
    for ratio, rate in _links(kv_bytes, t_comp, ratios, args.links_gbps):
        cells.append(_bench_cell(model, name, profile, store, job, ratio, rate, comp_layer, args))
        c = cells[-1]
        times = ", ".join(f"{p}={c['times_s'][p]:.3f}" for p in POLICIES)
        print(f"  Tio/Tcomp={ratio:.3g} ({rate * 8 / 1e9:.3g} Gbit/s): {times}, bound={c['bound_s']:.3f}", flush=True)
    return cells


def _links(kv_bytes: int, t_comp: float, ratios: Sequence[float], links_gbps: str) -> list[tuple[float, float]]:
    """(Tio/Tcomp, link bytes/s) per cell: fixed link speeds if given, else the speeds that give `ratios`."""
    if links_gbps:
        rates = [float(x) * 1e9 / 8 for x in links_gbps.split(",")]
        return [(kv_bytes / (rate * t_comp), rate) for rate in rates]
    return [(ratio, kv_bytes / (ratio * t_comp)) for ratio in ratios]


def _bench_cell(model: Transformer, name: str, profile: Profile, raw: ChunkStore, job: RestoreJob, ratio: float,
                rate: float, comp_layer: list[RestoreResult], args: argparse.Namespace) -> dict[str, Any]:
    def linked() -> ShapedStore:
        return ShapedStore(raw, TokenBucket(rate))

    costs, l_delta = profile.cost_model(rate), profile.l_delta_for(rate)
    # Load-only is bound by the emulated link, which is steady: one run per cell suffices.
    load_token = _forced(model, job, linked(), "token", 0)
    load_layer = _forced(model, job, linked(), "layer", 0)
    runs: dict[str, list[float]] = {p: [] for p in TIMED}
    comp_token: list[RestoreResult] = []
    modes: dict[str, str] = {}
    for _ in range(args.repeats):  # interleaved: drift on a shared machine hits every policy alike
        gc.collect()
        comp_token.append(_forced(model, job, raw, "token", len(job.keys)))
        for policy in TIMED[1:]:
            gc.collect()  # a collection inside a timed run would be charged to that policy
            result = restore(job, model=model, store=linked(), policy=policy, costs=costs, l_delta=l_delta)
            _require_complete(result)
            runs[policy].append(result.elapsed_s)
            modes[policy] = result.mode
    runs["compute-only"] = [r.elapsed_s for r in comp_token]
    times = {p: median(v) for p, v in runs.items()}
    times["load-only"] = load_token.elapsed_s
    token_bound = best_split(_unit_costs(comp_token), _unit_costs([load_token]))[1]
    layer_bound = best_split(_unit_costs(comp_layer), _unit_costs([load_layer]))[1]
    bound = min(token_bound, layer_bound)
    return {
        "model": name, "n_tokens": len(job.token_ids), "ratio": ratio, "link_gbps": rate * 8 / 1e9,
        "l_delta": l_delta, "adaptive_mode": modes["cacheflow"], "times_s": times, "runs_s": runs,
        "bound_s": bound, "token_bound_s": token_bound, "layer_bound_s": layer_bound,
        "ratio_to_bound": {p: t / bound for p, t in times.items()}, "load_average": os.getloadavg()[0],
    }


def _forced(model: Transformer, job: RestoreJob, store: ChunkStore, mode: str, split: int) -> RestoreResult:
    """A run with a fixed split: `split = n_units` is compute-only, `0` load-only."""
    loader = KVLoader(store=store, keys=job.keys, layers=job.layers, kv=_fresh_kv(model, job),
                      dtype=job.kv_dtype, quant=job.quant)
    result = run_restore(job, model=model, loader=loader, mode=mode, planner=FixedSplitPlanner(split),
                         policy=f"{mode}-split-{split}")
    _require_complete(result)
    return result


def _fresh_kv(model: Transformer, job: RestoreJob) -> KVBuffer:
    return model.new_kv(job.layers, len(job.token_ids))


def _require_complete(result: RestoreResult) -> None:
    if result.misses or result.loader_error:
        raise RuntimeError(f"benchmark restore had misses {dict(result.misses)} {result.loader_error}")


def _unit_costs(results: Sequence[RestoreResult]) -> list[float]:
    """Median duration of each unit over runs."""
    return [median([r.units[i].end_s - r.units[i].start_s for r in results]) for i in range(len(results[0].units))]


def summarize(cells: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The three targets of the core issue, as measured."""
    t = [c["times_s"] for c in cells]
    balance = [c for c in cells if c["ratio"] == 1.0]
    return {
        "max_ratio_to_bound": max(c["ratio_to_bound"]["cacheflow"] for c in cells),
        "ratio_to_best_baseline_at_balance": max(
            (c["times_s"]["cacheflow"] / min(c["times_s"]["compute-only"], c["times_s"]["load-only"]) for c in balance),
            default=None),
        "max_adaptive_regret": max(x["cacheflow"] / min(x["cacheflow-token"], x["cacheflow-layer"]) - 1 for x in t),
        "targets": {"max_ratio_to_bound": 1.15, "ratio_to_best_baseline_at_balance": 0.6, "max_adaptive_regret": 0.10},
        "cells": len(cells),
    }


def render_markdown(body: dict[str, Any]) -> str:
    s, m = body["summary"], body["machine"]
    header = ["model", "N", "Tio/Tcomp", "link Gbit/s", *POLICIES, "bound T*", "adaptive mode", "CF / T*"]
    rows = [[c["model"], c["n_tokens"], c["ratio"], round(c["link_gbps"], 3),
             *[c["times_s"][p] for p in POLICIES], c["bound_s"], c["adaptive_mode"],
             c["ratio_to_bound"]["cacheflow"]] for c in body["cells"]]
    return "\n".join([
        "# Single-request restore vs the optimal bound", "",
        f"Machine: {m['cpu']}, {m['cpus']} CPUs, torch {m['torch']} with {m['torch_threads']} threads"
        + (f", GPU {m['gpu']}" if m["gpu"] else ", no GPU") + f"; git {m['git']}.",
        f"Command: `{body['command']}`. Times in seconds (median of {body['settings']['repeats']}).", "",
        "| target | measured | goal |", "|---|---|---|",
        f"| CacheFlow (adaptive) / T*, worst cell | {_fmt(s['max_ratio_to_bound'])} | <= 1.15 |",
        f"| CacheFlow / best of compute-only and load-only at Tio/Tcomp = 1 | "
        f"{_fmt(s['ratio_to_best_baseline_at_balance'])} | <= 0.6 |",
        f"| adaptive vs better of token/layer, worst regret | {_fmt(s['max_adaptive_regret'])} | <= 0.10 |", "",
        markdown_table(header, rows), "",
    ])


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _plot(cells: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({c["model"] for c in cells})
    lengths = sorted({c["n_tokens"] for c in cells})
    fig, axes = plt.subplots(len(models), len(lengths), figsize=(3.2 * len(lengths), 2.8 * len(models)),
                             squeeze=False, sharey=True)
    for i, m in enumerate(models):
        for j, n in enumerate(lengths):
            ax = axes[i][j]
            sel = sorted((c for c in cells if c["model"] == m and c["n_tokens"] == n), key=lambda c: c["ratio"])
            if not sel:  # a length capped for this model
                ax.set_visible(False)
                continue
            for p in POLICIES:
                ax.plot([c["ratio"] for c in sel], [c["ratio_to_bound"][p] for c in sel], marker="o", label=p)
            ax.axhline(1.15, color="grey", ls=":", lw=1)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{m}, N={n}", fontsize=9)
            ax.set_xlabel("Tio/Tcomp")
            if j == 0:
                ax.set_ylabel("time / bound T*")
    axes[0][0].set_ylim(0.8, 4.5)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
