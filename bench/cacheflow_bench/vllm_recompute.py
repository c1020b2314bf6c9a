"""The vLLM bench's recompute mode: the connector's compute pointer against vLLM's own prefill, side by side
in one vLLM process.

One process runs the connector with `policy: compute-only` (the whole cached prefix recomputed by the
connector's restore, no loads) and alternates two prompts per length: one whose prefix the pod holds (the
connector recomputes it, vLLM then prefills the last 16 tokens) and a fresh one of the same length that no
pod holds (the lookup misses and vLLM prefills all of it). Lengths and repeats are interleaved after a
warm-up. A process per vLLM token budget (its default, and the whole prompt in one step): per length the
ratio is taken in the process where vLLM's own prefill was faster. The connector recomputes with vLLM's own
model (`runtime: vllm`, its default). One more process, default budget, runs it with `runtime: cacheflow`
(CacheFlow's runtime over vLLM's weights, attending with vLLM's CPU kernel): the runtime's ablation.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cacheflow_bench.common import median

if TYPE_CHECKING:
    from cacheflow_bench.vllm import Bench


def fresh_prompts(lengths: Sequence[int], suffix: int, vocab: int) -> dict[int, list[int]]:
    rng = random.Random(11)  # neither the stored prompts' seed nor the batch's: no pod holds these
    return {n: [rng.randrange(vocab) for _ in range(n + suffix)] for n in lengths}


def run_recompute(bench: Bench, lengths: Sequence[int], fresh: dict[int, list[int]], *, repeats: int,
                  budgets: tuple[int | None, ...]) -> dict[str, Any]:
    """Per length and process: the connector's recompute and vLLM's prefill (medians), and their ratio."""
    order = [(n, kind) for _ in range(repeats) for n in lengths for kind in ("connector", "vllm")]
    prompts = [bench.warm] + [bench.prompts[n] if kind == "connector" else fresh[n] for n, kind in order]
    runs: dict[str, dict[int, dict[str, float]]] = {}
    restores: dict[str, int] = {}
    settings = [(f"budget-{b or 'default'}", b, "vllm") for b in budgets] + [("runtime-cacheflow", None, "cacheflow")]
    for name, budget, runtime in settings:
        before = _restore_count(bench)
        cfg = bench.connector(policy="compute-only", save=False, runtime=runtime)
        times = bench.drive(f"recompute-side-by-side-{name}", prompts, cfg, budget)[1:]
        runs[name] = {n: {kind: median([t for (m, k), t in zip(order, times, strict=True) if (m, k) == (n, kind)])
                          for kind in ("connector", "vllm")} for n in lengths}
        restores[name] = _restore_count(bench) - before
    by_length = {}
    for n in lengths:
        fastest = min((name for name, _, runtime in settings if runtime == "vllm"),
                      key=lambda name: runs[name][n]["vllm"])
        by_length[n] = {"process": fastest, **runs[fastest][n],
                        "ratio": runs[fastest][n]["connector"] / runs[fastest][n]["vllm"],
                        "ratio_cacheflow_runtime": runs["runtime-cacheflow"][n]["connector"]
                        / runs["runtime-cacheflow"][n]["vllm"]}
    return {"lengths": list(lengths), "repeats": repeats, "runs": runs, "by_length": by_length,
            "restores_counted": restores, "summary": summarize(by_length, restores, 1 + len(lengths) * repeats)}


def _restore_count(bench: Bench) -> int:
    return bench.stats.read_text().count('"event": "restore"') if bench.stats.exists() else 0


def summarize(by_length: dict[int, dict[str, Any]], restores: dict[str, int], expected: int) -> dict[str, Any]:
    """`expected`: restores per process (the warm-up's and every stored prompt's)."""
    ratios = [row["ratio"] for row in by_length.values()]
    return {"connector_recompute_vs_vllm_prefill_max": max(ratios),
            "connector_recompute_vs_vllm_prefill": {str(n): row["ratio"] for n, row in by_length.items()},
            "connector_recompute_cacheflow_runtime_vs_vllm_prefill": {
                str(n): row["ratio_cacheflow_runtime"] for n, row in by_length.items()},
            "connector_recompute_restores_happened": all(count == expected for count in restores.values()),
            "targets": {"connector_recompute_vs_vllm_prefill_max": 1.05}}


def report_lines(recompute: dict[str, Any]) -> list[str]:
    s = recompute["summary"]
    rows = "\n".join(
        f"| {n} | {row['process']} | {row['vllm']:.3f} | {row['connector']:.3f} | **{row['ratio']:.2f}** | "
        f"{row['ratio_cacheflow_runtime']:.2f} |" for n, row in recompute["by_length"].items())
    return [
        "## Recompute: the connector's compute pointer against vLLM's own prefill, in one process", "",
        "`policy: compute-only`: the connector recomputes the whole cached prefix (then vLLM the last 16 tokens), "
        "alternating with a fresh prompt of the same length that vLLM prefills itself; medians of "
        f"{recompute['repeats']} each after a warm-up; per length, the process (vLLM token budget) where vLLM's "
        "prefill was faster. The connector recomputes with vLLM's own model (`runtime: vllm`). Last column: the "
        "same ratio with `runtime: cacheflow` (CacheFlow's runtime over vLLM's weights; default budget).", "",
        "| prefix | process | vLLM prefill (s) | connector recompute (s) | connector / vLLM | with CacheFlow's "
        "runtime |", "|---|---|---|---|---|---|", rows, "",
        f"Worst connector / vLLM: **{s['connector_recompute_vs_vllm_prefill_max']:.2f}** (target <= 1.05); every "
        f"recompute was a restore: {s['connector_recompute_restores_happened']}.", ""]
