"""Before and after: the headline numbers of the committed results at an earlier commit beside today's.

`python -m cacheflow_bench.before_after --rev REV` reads the result files as commit REV had them
(`git show REV:bench/results/NAME.json`) and writes their headline values to
bench/results/before_after.json; `cacheflow bench report` then sets them beside the current results
in REPORT.md. Used to show what a change that touches every measurement did (issue 42: the data plane
made quiet; every benchmark before it ran beside idle NIXL pods spinning a core each).
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections.abc import Sequence
from typing import Any

from cacheflow_bench.common import BENCH_DIR, RESULTS_DIR, markdown_table, write_json

# (result, dotted path into its JSON, what it is): the values compared
HEADLINES: tuple[tuple[str, str, str], ...] = (
    # the storage bench was rewritten after REV (its raw rates are not measured as they were): it is compared on
    # one bench in storage_before.json instead, this commit's bench run on REV's code
    ("stages", "summary.speedup_s2_vs_s1", "S = 2 from boundaries vs S = 1 (x faster)"),
    ("stages", "summary.speedup_s2_vs_pipelined", "S = 2 from boundaries vs pipelined (x faster)"),
    ("batch", "calibration.slowdown", "compute slowdown while loading (calibrated)"),
    ("batch", "summary.mean_ratio_vs_cake_b8", "batch 8: CacheFlow / Cake, mean TTFT"),
    ("batch", "summary.p99_ratio_vs_cake_b8", "batch 8: CacheFlow / Cake, P99 TTFT"),
    ("batch", "summary.mean_speedup_vs_compute_only_b8", "batch 8: compute-only / CacheFlow, mean"),
    ("batch", "summary.sim_mean_rel_error", "simulator: run means off by (worst)"),
    ("batch", "summary.sweep_worst_mean_ratio_vs_cake", "sweep: CacheFlow / Cake, worst mean"),
    ("batch", "summary.sweep_worst_max_ratio_vs_cake", "sweep: CacheFlow / Cake, worst slowest request"),
    ("batch", "summary.sweep_overload_median_mean_ratio_vs_cake", "sweep: CacheFlow / Cake, overload median mean"),
    ("batch", "summary.sweep_sim_mean_rel_error", "sweep: simulator error on the means"),
    ("vllm", "summary.connector_recompute_vs_vllm_prefill_max", "vLLM: connector recompute / vLLM prefill, worst"),
    ("vllm", "summary.vllm_batch_mean_ratio_vs_best_baseline", "vLLM batch: CacheFlow / best baseline, mean"),
    ("vllm", "summary.vllm_batch_p99_ratio_vs_cake", "vLLM batch: CacheFlow / Cake, P99"),
    ("vllm", "summary.vllm_rate_sweep_worst_mean_ratio_vs_best_baseline", "vLLM serving: worst mean vs best baseline"),
    ("vllm", "summary.vllm_rate_sweep_worst_p99_ratio_vs_best_baseline", "vLLM serving: worst P99 vs best baseline"),
)


def value_at(body: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        if not isinstance(body, dict) or key not in body:
            return None
        body = body[key]
    return body


def result_at(rev: str, name: str) -> dict[str, Any]:
    """Result `name` as commit `rev` had it ({} where it had none)."""
    shown = subprocess.run(["git", "show", f"{rev}:bench/results/{name}.json"], capture_output=True, text=True,
                           cwd=BENCH_DIR.parent, check=False)
    return json.loads(shown.stdout) if shown.returncode == 0 else {}


def main(argv: Sequence[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(prog="python -m cacheflow_bench.before_after", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rev", required=True, help="the commit whose results are 'before'")
    args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    bodies = {name: result_at(args.rev, name) for name in {name for name, _, _ in HEADLINES}}
    before = {f"{name}:{path}": value_at(bodies[name], path) for name, path, _ in HEADLINES}
    commits = {name: body.get("machine", {}).get("git") for name, body in bodies.items()}
    write_json(RESULTS_DIR / "before_after.json", {"rev": args.rev, "commits": commits, "before": before})
    print(f"wrote {RESULTS_DIR / 'before_after.json'}")
    return 0


def section(results: dict[str, dict[str, Any]], before_after: dict[str, Any]) -> list[str]:
    """REPORT.md's side-by-side table: each headline before (at the recorded commit) and now."""
    rows = []
    for name, path, what in HEADLINES:
        now = value_at(results.get(name, {}), path)
        was = before_after["before"].get(f"{name}:{path}")
        commit = before_after["commits"].get(name) or "?"
        rows.append([what, "-" if was is None else was, commit, "-" if now is None else now])
    return ["## Before and after the quiet data plane", "",
            f"The committed results before the change (as of {before_after['rev']}; each measured at the commit "
            "named, beside idle NIXL pods that each held a core at 100 %) and the current ones.", "",
            markdown_table(["headline", "before", "measured at", "now"], rows), ""]


if __name__ == "__main__":
    raise SystemExit(main())
