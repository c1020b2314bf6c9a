"""Shared benchmark plumbing: machine facts, result files (JSON + Markdown), thread settings."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parents[1]  # bench/: this package, its results and the trace
RESULTS_DIR = BENCH_DIR / "results"  # the committed results (what `cacheflow bench report` publishes)
SCRATCH_DIR = RESULTS_DIR / "tmp"  # git-ignored: where --quick runs write unless --out says otherwise
# The Mooncake conversation trace (FAST'25 release, Apache-2.0: LICENSE-APACHE-mooncake beside it).
TRACE = BENCH_DIR / "traces" / "mooncake_conversation_trace.jsonl.gz"


def machine_facts() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "git": _git_revision(),
    }


def _git_revision() -> str:
    """The commit the code comes from; `-dirty` when files outside bench/results differ from it (then the
    numbers belong to no commit, and `cacheflow bench report` will not publish them as one)."""
    head = _git("rev-parse", "--short", "HEAD").strip()
    changed = [line[3:] for line in _git("status", "--porcelain", "--untracked-files=no").splitlines()]
    dirty = any(not path.startswith("bench/results/") for path in changed)
    return f"{head}-dirty" if head and dirty else head


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=BENCH_DIR.parent, check=False)
    except OSError:
        return ""
    return out.stdout


def command_line() -> str:
    """The command that is running, as a user would type it (`cacheflow ...`, or `python -m cacheflow_bench.X ...`)."""
    program = Path(sys.argv[0]).stem
    head = ["cacheflow"] if program == "cacheflow" else ["python", "-m", f"cacheflow_bench.{program}"]
    return " ".join([*head, *sys.argv[1:]])


def add_out_option(parser: argparse.ArgumentParser) -> None:
    """`--out`: by default the committed results, or with --quick the scratch folder (see `results_dir`)."""
    parser.add_argument("--out", default=None,
                        help=f"output directory (default: {RESULTS_DIR}; with --quick: {SCRATCH_DIR}, git-ignored)")


def results_dir(args: argparse.Namespace) -> Path:
    """Where a run writes: --out, else a --quick run's scratch folder (said on the terminal: a smoke run
    never overwrites the committed results), else the committed results folder."""
    if args.out:
        return Path(args.out)
    if args.quick:
        print(f"--quick: results go to {SCRATCH_DIR} (the committed ones in {RESULTS_DIR} are left alone)",
              flush=True)
        return SCRATCH_DIR
    return RESULTS_DIR


def provenance(quick: bool) -> dict[str, Any]:
    """What every result file records: the machine, the command, and whether it was a --quick smoke run."""
    return {"machine": machine_facts(), "command": command_line(), "quick": quick}


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def write_json(path: Path, body: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")


def publish(args: argparse.Namespace, name: str, body: dict[str, Any],
            report: Callable[[dict[str, Any]], str]) -> int:
    """Write a run's `name`.json and its report `name`.md where `results_dir(args)` says; print its summary."""
    out = results_dir(args)
    write_json(out / f"{name}.json", body)
    (out / f"{name}.md").write_text(report(body))
    print(json.dumps(body["summary"]))
    return 0


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)
