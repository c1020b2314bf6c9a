"""The vLLM bench's batch mode: requests with cached prefixes of 1k-4k tokens arrive at vLLM together.

vLLM hands them to the connector together, and the connector restores them at once with the stage
engine's batch scheduler (one compute loop and the pod's channel shared by all of them). Columns: vLLM's
own recompute (the faster of its default token budget and a whole-prompt one), load-only, Cake and
CacheFlow restoring in the background while the requests wait (the connector's default), CacheFlow
restoring inside vLLM's step (`async_loads: false`: the whole batch waits for every restore), and, in the
step, CacheFlow with `batch_restores: false` (the step's restores one after another) as an ablation. The
one pod's link is emulated at the rate that makes loading every prefix take as long as vLLM's recompute
of the batch (Tio/Tcomp = 1 for the batch). Each configuration runs in a fresh vLLM process: a warm-up
request alone, then the batch `repeats` times; TTFT is each request's time from the batch's submission
to its first token; the mean and P99 over the batch are medians over the repeats.
"""

from __future__ import annotations

import random
import statistics
from typing import TYPE_CHECKING, Any

from cacheflow_bench.common import median
from cacheflow_common.sim import percentile

if TYPE_CHECKING:
    from cacheflow_bench.vllm import Bench

BATCH_PREFIXES = (1024, 1280, 1792, 2304, 2560, 3072, 3584, 4096)
# column -> the connector's settings: restores in the background (the default), or inside vLLM's step
COLUMNS: dict[str, dict[str, Any]] = {
    "load-only": {"policy": "load-only"}, "cake": {"policy": "cake"}, "cacheflow": {"policy": "cacheflow"},
    "cacheflow-sync": {"policy": "cacheflow", "async_loads": False},
    "cacheflow-per-request": {"policy": "cacheflow", "async_loads": False, "batch_restores": False}}


def prompts_for(prefixes: tuple[int, ...], suffix: int, vocab: int) -> list[list[int]]:
    rng = random.Random(7)  # not the single-request prompts' seed: these are other prefixes
    return [[rng.randrange(vocab) for _ in range(n + suffix)] for n in prefixes]


def run_batch(bench: Bench, prompts: list[list[int]], *, repeats: int, budgets: tuple[int | None, ...],
              kv_bytes: int) -> dict[str, Any]:
    """Every column's TTFTs for the batch; `kv_bytes`: the prefixes' KV, which sets the link."""
    n = len(prompts)
    sent = [bench.warm, *(prompts * repeats)]
    batches = [[0]] + [list(range(1 + r * n, 1 + (r + 1) * n)) for r in range(repeats)]
    recompute = {str(b or "default"): _runs(bench.results(f"batch-recompute-{b or 'default'}", sent, None, b,
                                                          batches), n) for b in budgets}
    best = min(recompute, key=lambda b: _stat(recompute[b], "mean_s"))
    columns: dict[str, Any] = {"recompute": recompute[best]}
    rate = kv_bytes * 8 / _stat(recompute[best], "max_s") / 1e9
    bench.start_pod()
    bench.results("batch-save", [bench.warm, *prompts], bench.connector())
    bench.start_pod(rate)
    names = list(COLUMNS)
    for i in range(len(names)):  # every column in its own process; the order rotated against the single rows
        name = names[(i + 1) % len(names)]
        cfg = bench.connector(**COLUMNS[name], save=False, profile=str(bench.profile), link_gbps=rate)
        results = bench.results(f"batch-{name}", sent, cfg, batches=batches)
        columns[name] = _runs(results, n) | {"next_token_matches": _same_tokens(results, bench, best)}
    return {"prefixes": [len(p) for p in prompts], "repeats": repeats, "rate_gbps": rate, "link_emulated": True,
            "recompute_budget": best, "recompute_by_budget": recompute, "columns": columns,
            "summary": summarize(columns)}


def _runs(results: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Per repeat of the batch: each request's TTFT, their mean, P99 and max."""
    repeats = [[r["first_token_s"] for r in results[1 + i : 1 + i + n]] for i in range(0, len(results) - 1, n)]
    return {"ttft_s": repeats, "mean_s": [statistics.fmean(t) for t in repeats],
            "p99_s": [percentile(sorted(t), 99) for t in repeats], "max_s": [max(t) for t in repeats]}


def _stat(runs: dict[str, Any], key: str) -> float:
    return median(runs[key])


def _same_tokens(results: list[dict[str, Any]], bench: Bench, budget: str) -> bool:
    """Whether every request's greedy next token equals the one vLLM's own recompute gave it."""
    reference = bench.first_tokens[f"batch-recompute-{budget}"]
    return [r["tokens"][0] for r in results[1:]] == reference[1:]


def summarize(columns: dict[str, Any]) -> dict[str, Any]:
    mean = {name: _stat(runs, "mean_s") for name, runs in columns.items()}
    p99 = {name: _stat(runs, "p99_s") for name, runs in columns.items()}
    best = min(("recompute", "load-only", "cake"), key=lambda name: mean[name])
    return {"vllm_batch_mean_ratio_vs_best_baseline": mean["cacheflow"] / mean[best], "vllm_batch_best_baseline": best,
            "vllm_batch_p99_ratio_vs_cake": p99["cacheflow"] / p99["cake"],
            "vllm_batch_mean_ratio_vs_cake": mean["cacheflow"] / mean["cake"],
            "vllm_batch_batched_vs_per_request": mean["cacheflow-sync"] / mean["cacheflow-per-request"],
            "vllm_batch_async_vs_sync_mean": mean["cacheflow"] / mean["cacheflow-sync"],
            "vllm_batch_async_vs_sync_p99": p99["cacheflow"] / p99["cacheflow-sync"],
            "vllm_batch_next_token_matches": all(columns[c]["next_token_matches"] for c in COLUMNS),
            "vllm_batch_mean_s": mean, "vllm_batch_p99_s": p99,
            "targets": {"vllm_batch_mean_ratio_vs_best_baseline": 0.85, "vllm_batch_p99_ratio_vs_cake": 0.90}}


def report_lines(batch: dict[str, Any]) -> list[str]:
    s = batch["summary"]
    rows = "\n".join(f"| {name} | {s['vllm_batch_mean_s'][name]:.3f} | {s['vllm_batch_p99_s'][name]:.3f} |"
                     for name in ("recompute", *COLUMNS))
    verdict = "" if s["vllm_batch_mean_ratio_vs_cake"] < 1 else " **CacheFlow does not beat Cake here.**"
    return [
        f"## Batch: {len(batch['prefixes'])} requests with cached prefixes of "
        f"{min(batch['prefixes'])}-{max(batch['prefixes'])} tokens arriving together", "",
        f"One pod, its link emulated at {batch['rate_gbps']:.3f} Gbit/s (loading every prefix takes as long as "
        f"vLLM recomputing the batch, budget {batch['recompute_budget']}); medians over {batch['repeats']} "
        "repeats of each batch's mean and P99 TTFT. Every connector column restores in the background (the "
        "default) except `cacheflow-sync` (CacheFlow restoring inside vLLM's step, `async_loads: false`) and "
        "`cacheflow-per-request` (in the step, `batch_restores: false`: the step's restores one after another).",
        "",
        "| column | mean TTFT (s) | P99 TTFT (s) |", "|---|---|---|", rows, "",
        f"CacheFlow mean / the best baseline's ({s['vllm_batch_best_baseline']}): "
        f"**{s['vllm_batch_mean_ratio_vs_best_baseline']:.3f}** (target <= 0.85); P99 / Cake's: "
        f"**{s['vllm_batch_p99_ratio_vs_cake']:.3f}** (target <= 0.90); mean / Cake's "
        f"{s['vllm_batch_mean_ratio_vs_cake']:.3f}.{verdict} Background / in-step restores: mean "
        f"{s['vllm_batch_async_vs_sync_mean']:.3f}, P99 {s['vllm_batch_async_vs_sync_p99']:.3f}. In the step, "
        f"batched / per-request restores: {s['vllm_batch_batched_vs_per_request']:.3f}. Greedy next tokens "
        f"equal vLLM's own: {s['vllm_batch_next_token_matches']}.", ""]
