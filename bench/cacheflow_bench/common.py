"""Shared benchmark plumbing: machine facts, result files (JSON + Markdown), thread settings."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parents[1]  # bench/: this package, its results and the trace
RESULTS_DIR = BENCH_DIR / "results"
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
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, check=False)
    except OSError:
        return ""
    return out.stdout.strip()


def command_line() -> str:
    """The command that is running, as a user would type it (`cacheflow ...`, or `python -m cacheflow_bench.X ...`)."""
    program = Path(sys.argv[0]).stem
    head = ["cacheflow"] if program == "cacheflow" else ["python", "-m", f"cacheflow_bench.{program}"]
    return " ".join([*head, *sys.argv[1:]])


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def write_json(path: Path, body: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        return f"{x:.3f}" if isinstance(x, float) else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)
