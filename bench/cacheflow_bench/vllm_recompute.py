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

A connector request's time splits in two: the restore itself (its `elapsed_s` in the connector's stats) and
the rest, mostly the step in which vLLM computes the prompt's last 16 tokens after the restore (a pass over
the weights that vLLM's own prefill folds into its one forward); both are reported per length.
"""

from __future__ import annotations

import json
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
    connector_runs = [n for n, kind in order if kind == "connector"]
    settings = [(f"budget-{b or 'default'}", b, "vllm") for b in budgets] + [("runtime-cacheflow", None, "cacheflow")]
    for name, budget, runtime in settings:
        before = len(_restore_times(bench))
        cfg = bench.connector(policy="compute-only", save=False, runtime=runtime)
        times = bench.drive(f"recompute-side-by-side-{name}", prompts, cfg, budget)[1:]
        runs[name] = {n: {kind: median([t for (m, k), t in zip(order, times, strict=True) if (m, k) == (n, kind)])
                          for kind in ("connector", "vllm")} for n in lengths}
        restored = _restore_times(bench)[before:]
        restores[name] = len(restored)
        if len(restored) == 1 + len(connector_runs):  # the warm-up's, then each connector prompt's, in order
            ttft = [t for (_, kind), t in zip(order, times, strict=True) if kind == "connector"]
            for n in lengths:
                pairs = [(t, r) for m, t, r in zip(connector_runs, ttft, restored[1:], strict=True) if m == n]
                runs[name][n]["restore"] = median([r for _, r in pairs])
                runs[name][n]["rest"] = median([t - r for t, r in pairs])
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


def _restore_times(bench: Bench) -> list[float]:
    """Every restore's own time in the connector's stats so far (seconds), in the order they ended."""
    if not bench.stats.exists():
        return []
    events = (json.loads(line) for line in bench.stats.read_text().splitlines())
    return [e["elapsed_s"] for e in events if e["event"] == "restore"]


def summarize(by_length: dict[int, dict[str, Any]], restores: dict[str, int], expected: int) -> dict[str, Any]:
    """`expected`: restores per process (the warm-up's and every stored prompt's)."""
    ratios = [row["ratio"] for row in by_length.values()]
    return {"connector_recompute_vs_vllm_prefill_max": max(ratios),
            "connector_recompute_vs_vllm_prefill": {str(n): row["ratio"] for n, row in by_length.items()},
            "connector_restore_only_vs_vllm_prefill": {str(n): row["restore"] / row["vllm"]
                                                       for n, row in by_length.items() if "restore" in row},
            "connector_recompute_cacheflow_runtime_vs_vllm_prefill": {
                str(n): row["ratio_cacheflow_runtime"] for n, row in by_length.items()},
            "connector_recompute_restores_happened": all(count == expected for count in restores.values()),
            "targets": {"connector_recompute_vs_vllm_prefill_max": 1.05}}


def _split(row: dict[str, Any]) -> str:
    return f"{row['restore']:.3f} / {row['rest']:.3f}" if "restore" in row else "—"


def report_lines(recompute: dict[str, Any]) -> list[str]:
    s = recompute["summary"]
    rows = "\n".join(
        f"| {n} | {row['process']} | {row['vllm']:.3f} | {row['connector']:.3f} | {_split(row)} | "
        f"**{row['ratio']:.2f}** | {row['ratio_cacheflow_runtime']:.2f} |" for n, row in recompute["by_length"].items())
    return [
        "## Recompute: the connector's compute pointer against vLLM's own prefill, in one process", "",
        "`policy: compute-only`: the connector recomputes the whole cached prefix (then vLLM the last 16 tokens), "
        "alternating with a fresh prompt of the same length that vLLM prefills itself; medians of "
        f"{recompute['repeats']} each after a warm-up; per length, the process (vLLM token budget) where vLLM's "
        "prefill was faster. The connector recomputes with vLLM's own model (`runtime: vllm`). Last column: the "
        "same ratio with `runtime: cacheflow` (CacheFlow's runtime over vLLM's weights; default budget).", "",
        "The split: the restore's own time (the connector's stats) / the rest of the request's time, mostly "
        "vLLM's step for the last 16 tokens after the restore (one more pass over the weights).", "",
        "| prefix | process | vLLM prefill (s) | connector recompute (s) | of it: restore / rest (s) "
        "| connector / vLLM | with CacheFlow's runtime |", "|---|---|---|---|---|---|---|", rows, "",
        f"Worst connector / vLLM: **{s['connector_recompute_vs_vllm_prefill_max']:.2f}** (target <= 1.05); every "
        f"recompute was a restore: {s['connector_recompute_restores_happened']}.", ""]
