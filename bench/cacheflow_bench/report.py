"""`cacheflow bench report`: the paper's figures on our system, from the benchmarks' results.

With `--run` it first runs the suite (`restore`, `storage`, `latency`, `stages`, `batch`, `sched-scale`,
`sweep`, `chaos`, and `vllm`, `vllm_memory`, `vllm-stall` and `vllm-eagle` (with an EAGLE draft and with a
draft model) where vLLM's virtual environment exists;
`--quick` for their smoke settings, into bench/results/tmp), then it (re)writes `REPORT.md` and its figures
in the results folder from whatever results are there, and, for the committed results, the benchmark table of the
repository's README.md (between its `<!-- benchmark-table:begin -->` and `<!-- benchmark-table:end -->`
markers). One report, one commit: it refuses results of different commits, or of uncommitted code
(`-dirty`), unless given `--allow-mixed`, which marks every section with its commit (as a smoke report
does). It refuses results of `--quick` runs (each result file records the flag) unless given `--quick`
itself, which makes a smoke report, marked as such. Real measurements on this machine, the simulator's
cluster-scale figures labelled as simulated; a figure whose benchmark has not run is listed as missing, not
drawn.

    Fig. 4  TTFT CDF per policy (batch replay of the trace, largest batch)        batch.json
    Fig. 5  compute and I/O utilisation during restore (simulated cluster)        batch.json
    Fig. 6  restore time by prefix length, Tio/Tcomp = 1                          restore_single.json
    Fig. 7  ablation: token-wise, layer-wise, adaptive vs the bound, per length x ratio
    Fig. 7a/b  restore time vs link speed (Tio/Tcomp), shortest and longest prefix
    Fig. 9  TTFT by batch size: measured (local cluster) and simulated (8 stages)  batch.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from cacheflow_bench import before_after, readme_table
from cacheflow_bench import report_figures as figs
from cacheflow_bench.batch_report import target_rows
from cacheflow_bench.common import RESULTS_DIR, SCRATCH_DIR, machine_facts, markdown_table, results_dir
from cacheflow_bench.readme_table import commit_of, commit_problems

SUITE = ("restore_single", "storage", "latency", "stages", "batch", "sched_scale", "sweep", "chaos", "vllm",
         "vllm_memory", "vllm_stall", "vllm_stall_eagle", "vllm_stall_step256", "vllm_stall_eagle_step256",
         "vllm_eagle", "vllm_draft_model")  # each writes <name>.json
# a benchmark's module in cacheflow_bench, where not named as its results, and the arguments that make it write them
MODULES = {"stages": "parallel_stages", "vllm_draft_model": "vllm_eagle", "vllm_stall_eagle": "vllm_stall",
           "vllm_stall_step256": "vllm_stall", "vllm_stall_eagle_step256": "vllm_stall"}
SETTING = {"vllm_draft_model": ["--draft", "draft_model"], "vllm_stall_eagle": ["--draft", "eagle"],
           "vllm_stall_step256": ["--step-tokens", "256"],
           "vllm_stall_eagle_step256": ["--draft", "eagle", "--step-tokens", "256"]}
Section = Callable[[dict[str, dict[str, Any]], Path, bool], list[str]]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cacheflow bench report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="store_true", help="run the benchmark suite first")
    p.add_argument("--quick", action="store_true",
                   help="a smoke report: with --run, each benchmark's smoke settings; results of --quick runs accepted")
    p.add_argument("--out", default=None, help=f"results folder, read and REPORT.md written there (default: "
                                               f"{RESULTS_DIR}; with --quick: {SCRATCH_DIR})")
    p.add_argument("--allow-mixed", action="store_true",
                   help="accept results of different commits or of uncommitted code; each section names its commit")
    p.add_argument("--readme", default=None,
                   help="the README whose benchmark table to rewrite (default: the repository's README.md, only for "
                        f"the results in {RESULTS_DIR} without --quick)")
    return p.parse_args(argv)


def quick_results(results: dict[str, dict[str, Any]]) -> list[str]:
    """The result files that --quick (smoke) runs produced."""
    return [f"{name}.json" for name, body in results.items() if body.get("quick")]


# The published settings where they differ from a benchmark's defaults, so that the suite fits one sitting
# (about an hour on 2 cores): the restore grid without its slowest cells (its default is ~70 minutes).
PUBLISHED = {"restore_single": ["--lengths", "1024,2048,4096", "--ratios", "0.5,1,2", "--cap", "smollm2=2048"]}


def benchmark_module(name: str) -> ModuleType:
    """The module of the suite's benchmark `name` (its `main` runs it)."""
    import importlib

    return importlib.import_module(f"cacheflow_bench.{MODULES.get(name, name)}")


def run_suite(out: Path, quick: bool) -> None:
    from cacheflow_bench.vllm import VLLM_PYTHON

    for name in SUITE:
        if name.startswith("vllm") and not VLLM_PYTHON.exists():
            print(f"== {name} skipped: {VLLM_PYTHON} is missing (create it as .ci/run does)", flush=True)
            continue
        print(f"== {name}", flush=True)
        args = ["--out", str(out), *SETTING.get(name, [])] + (["--quick"] if quick else PUBLISHED.get(name, []))
        if benchmark_module(name).main(args) != 0:
            raise SystemExit(f"benchmark {name} failed")


def load_results(out: Path) -> dict[str, dict[str, Any]]:
    found = {}
    for name in SUITE:
        path = out / f"{name}.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


def provenance(body: dict[str, Any]) -> str:
    m = body.get("machine", {})
    return (f"Machine: {m.get('cpu', '?')}, {m.get('cpus', '?')} CPUs, commit {commit_of(body) or '?'}. "
            f"Command: `{body.get('command', '?')}`.")


def heading(title: str, body: dict[str, Any], mixed: bool) -> str:
    """A section's heading; naming the commit its results come from when the report mixes commits."""
    return f"## {title}" + (f" (commit {commit_of(body) or '?'})" if mixed else "")


def batch_sections(results: dict[str, dict[str, Any]], out: Path, mixed: bool) -> list[str]:
    body = results.get("batch")
    if body is None:
        return ["## Fig. 4, 5, 9: batch replay", "", "Missing: run `cacheflow bench batch`.", ""]
    figs.ttft_cdf(out / "fig4_ttft_cdf.png", body["runs"])
    lines = [heading("Fig. 4: TTFT CDF per policy (measured)", body, mixed), "",
             f"{len(body['requests'])} Mooncake conversation-trace requests replayed on the local cluster (tiny "
             f"model, 2 stage workers, 2 storage pods at {body['link_gbps_per_pod'] * 1000:.1f} Mbit/s each: "
             f"Tio/Tcomp = 1), largest batch. {provenance(body)}", "", "![TTFT CDF](fig4_ttft_cdf.png)", ""]
    if any("stage_utilization" in r for r in body["cluster_scale"]):
        figs.utilization(out / "fig5_utilization.png", body["cluster_scale"])
        lines += [heading("Fig. 5: compute and I/O utilisation during restore (simulated)", body, mixed), "",
                  "The simulator (costs profiled on this machine) at cluster scale: 8 stages, 8 storage channels, "
                  "Tio/Tcomp = 1; mean utilisation of the stages' compute and of the channels over the run, and "
                  "the share of prefix tokens recomputed.", "", "![utilisation](fig5_utilization.png)", ""]
    else:
        lines += [heading("Fig. 5: utilisation", body, mixed), "",
                  "Missing: rerun `cacheflow bench batch` (older results).", ""]
    figs.batch_sizes(out / "fig9_batch_sizes.png", body["runs"], body["cluster_scale"])
    if cap_never_binds(body["cluster_scale"]):
        lines += ["Note: the simulated figures are the same for every batch cap: at this trace's arrival rate no "
                  "stage ever holds as many requests as the smallest cap, so the cap never binds.", ""]
    s = body["summary"]
    lines += [heading("Fig. 9: TTFT by batch size", body, mixed), "",
              "Left: measured on the local cluster. Right: simulated, 8 stages, Tio/Tcomp = 1.", "",
              "![batch sizes](fig9_batch_sizes.png)", "",
              markdown_table(["target", "measured", "goal"], target_rows(s)), ""]
    return lines


def cap_never_binds(scale: list[dict[str, Any]]) -> bool:
    """Whether every simulated policy and link gave the same TTFTs at every batch cap."""
    seen: dict[tuple[str, float], set[tuple[float, float]]] = {}
    for r in scale:
        seen.setdefault((r["policy"], r["tio_over_tcomp"]), set()).add((r["mean_s"], r["p99_s"]))
    return len({r["batch"] for r in scale}) > 1 and all(len(v) == 1 for v in seen.values())


def single_sections(results: dict[str, dict[str, Any]], out: Path, mixed: bool) -> list[str]:
    body = results.get("restore_single")
    if body is None:
        return ["## Fig. 6, 7: single-request restore", "", "Missing: run `cacheflow bench restore`.", ""]
    cells, where = body["cells"], provenance(body)
    figs.by_length(out / "fig6_by_length.png", cells)
    figs.ablation(out / "fig7_ablation.png", cells)
    figs.link_sweep(out / "fig7ab_link_sweep.png", cells)
    s = body["summary"]
    return [heading("Fig. 6: restore time by prefix length (measured)", body, mixed), "",
            f"One request restored on this machine at Tio/Tcomp = 1 (a shaped in-process store), every policy. {where}",
            "", "![by length](fig6_by_length.png)", "",
            heading("Fig. 7: ablation, token-wise vs layer-wise vs adaptive (measured)", body, mixed), "",
            "Restore time / the optimal two-pointer bound for each prefix length x Tio/Tcomp (1.0 = optimal).",
            "", "![ablation](fig7_ablation.png)", "",
            heading("Fig. 7a/b: link-speed sweep (measured)", body, mixed), "",
            "Restore time as the link gets slower (Tio/Tcomp up), shortest and longest prefix per model.", "",
            "![link sweep](fig7ab_link_sweep.png)", "",
            markdown_table(["target", "measured", "goal"], single_rows(s)), ""]


def single_rows(s: dict[str, Any]) -> list[list[Any]]:
    """The single-request targets, Cake beside CacheFlow (keys older results lack read n/a)."""
    def get(key: str) -> Any:
        return s.get(key, "n/a (rerun `cacheflow bench restore`)")

    vs_cake = s.get("cacheflow_vs_cake_at_balance")
    verdict = " (CacheFlow does not beat Cake)" if vs_cake is not None and vs_cake >= 1 else ""
    return [["CacheFlow / Cake at Tio/Tcomp = 1 (median over prefix lengths)" + verdict,
             get("cacheflow_vs_cake_at_balance"), ""],
            ["CacheFlow / best baseline at Tio/Tcomp = 1", get("ratio_to_best_baseline_at_balance"), "<= 0.6"],
            ["Cake / best baseline at Tio/Tcomp = 1", get("cake_to_best_baseline_at_balance"), ""],
            ["worst restore time / bound (CacheFlow)", get("max_ratio_to_bound"), "<= 1.15"],
            ["worst restore time / bound (Cake)", get("max_cake_ratio_to_bound"), ""],
            ["run-to-run spread of the bound T*", get("bound_spread"), ""],
            ["adaptive regret vs the better fixed mode", get("max_adaptive_regret"), "<= 0.1"]]


def other_sections(results: dict[str, dict[str, Any]], out: Path, mixed: bool) -> list[str]:
    lines = []
    for name, title in (("storage", "Storage data plane"), ("latency", "Fixed costs: hops, a lone restore, decode"),
                        ("stages", "Parallel stages from boundary activations"),
                        ("sched_scale", "The batch scheduler at production batch sizes"),
                        ("sweep", "Trace sweep: the batch scheduler over windows and load levels"),
                        ("chaos", "Kills and abuse (chaos)"), ("vllm", "vLLM connector"),
                        ("vllm_memory", "vLLM memory with the connector"),
                        ("vllm_stall", "A restore beside decoding requests (vLLM)"),
                        ("vllm_stall_eagle", "A restore beside decoding requests, with an EAGLE draft (vLLM)"),
                        ("vllm_stall_step256", "A restore beside decoding requests, prefill chunked at 256 (vLLM)"),
                        ("vllm_stall_eagle_step256",
                         "A restore beside decoding requests, with an EAGLE draft, prefill chunked at 256 (vLLM)"),
                        ("vllm_eagle", "An EAGLE draft in a restore (vLLM)"),
                        ("vllm_draft_model", "A draft model in a restore (vLLM)")):
        body = results.get(name)
        if body is None:
            continue
        summary = body.get("headline", body["summary"])  # the sweep's summary is per level; its headline is flat
        rows = [[k, v] for k, v in summary.items() if not isinstance(v, dict | list)]
        figure = {"sweep": "sweep.png", "vllm": "vllm_rates.png", "sched_scale": "sched_scale.png"}.get(name)
        plot = [f"![{name}]({figure})", ""] if figure and (out / figure).exists() else []
        lines += [heading(title, body, mixed), "", provenance(body), "", markdown_table(["summary", "value"], rows),
                  "", *plot, f"Details: [{name}.md]({name}.md).", ""]
    return lines


def before_after_section(results: dict[str, dict[str, Any]], out: Path, mixed: bool) -> list[str]:
    path = out / "before_after.json"
    return before_after.section(results, json.loads(path.read_text())) if path.exists() else []


SECTIONS: tuple[Section, ...] = (batch_sections, single_sections, other_sections, before_after_section)


def write_report(out: Path, results: dict[str, dict[str, Any]], *, smoke: bool = False) -> Path:
    problems = commit_problems(results)
    lines = ["# CacheFlow benchmark report", "",
             "Regenerated by `cacheflow bench report` from the results in this folder (`--run` reruns the suite). "
             "Measured figures come from this machine (CPU); simulated ones say so.", "", origin(results, problems), ""]
    if smoke:
        lines += ["**Smoke report (`--quick`): results of the benchmarks' smoke settings, not measurements to "
                  "publish or compare.**", ""]
    for section in SECTIONS:
        lines += section(results, out, bool(problems))
    path = out / "REPORT.md"
    path.write_text("\n".join(lines))
    return path


def origin(results: dict[str, dict[str, Any]], problems: list[str]) -> str:
    """The report's one line on where its results come from: one commit, or several (each section says which)."""
    if not results:
        return "No results yet."
    if not problems:
        return f"Every result comes from commit {commit_of(next(iter(results.values())))}."
    return (f"**These results come from several commits, or from uncommitted code** ({'; '.join(problems)}); each "
            "section names its commit. Run `cacheflow bench report --run` on one clean commit to publish them.")


def refusal(args: argparse.Namespace, out: Path, results: dict[str, dict[str, Any]]) -> str | None:
    """Why these results may not make a report (one line), or None."""
    if not args.quick and (quick := quick_results(results)):
        return (f"{', '.join(quick)} in {out} come from --quick runs (smoke settings, not measurements): rerun those "
                "benchmarks without --quick, or make a smoke report with --quick")
    if not (args.allow_mixed or args.quick) and (problems := commit_problems(results)):  # a smoke report: marked
        return (f"the results in {out} are not all of one committed commit ({', '.join(problems)}): rerun them with "
                "`cacheflow bench report --run` on a clean checkout, or pass --allow-mixed")
    return None


def readme_path(args: argparse.Namespace, out: Path) -> Path | None:
    """The README whose table to rewrite: --readme, else the repository's for the committed, non-smoke results."""
    if args.readme:
        return Path(args.readme)
    return readme_table.README if not args.quick and out.resolve() == RESULTS_DIR.resolve() else None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    out = results_dir(args)
    if args.run:
        commit = machine_facts()["git"]
        if commit.endswith("-dirty") and not (args.allow_mixed or args.quick):
            print(f"cacheflow bench report: error: the code differs from commit {commit.removesuffix('-dirty')} "
                  "(git status): commit it first, so that the results belong to one commit, or pass --allow-mixed",
                  file=sys.stderr)
            return 2
        run_suite(out, args.quick)
    results = load_results(out)
    if why := refusal(args, out, results):
        print(f"cacheflow bench report: error: {why}", file=sys.stderr)
        return 2
    print(f"report: {write_report(out, results, smoke=args.quick)}")
    readme = readme_path(args, out)
    if readme is None:
        print(f"README table left alone (it shows the committed results in {RESULTS_DIR}, not {out})")
    else:
        changed = readme_table.update_readme(readme, results)
        print(f"README table: {readme} ({'rewritten' if changed else 'already up to date'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
