"""A second `cacheflow up` on the directory or the port of one that runs fails at once, in one line,
and starts nothing: no pod, no worker, no model loaded, nothing written in the first one's directory
(real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.reliability.up_cluster import start_up, write_spec

SECOND_S = 120.0  # a bound for the test, not a timing claim: the second `up` imports torch, then stops


def _second_up(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cacheflow_services.cli", "up", *args], capture_output=True,
                          text=True, timeout=SECOND_S, env={**os.environ, "CACHEFLOW_CACHE": str(tmp_path / "cache")})


def _files(directory: Path) -> set[Path]:
    return {p for p in directory.rglob("*") if p.is_file()}


def _one_line_error(second: subprocess.CompletedProcess[str]) -> str:
    assert second.returncode == 2, second
    assert second.stderr.count("\n") == 1 and second.stderr.startswith("cacheflow: error: "), second.stderr
    assert "starting" not in second.stdout and "ready on port" not in second.stdout, second.stdout
    return second.stderr


def test_a_second_up_on_the_same_directory_or_port_fails_in_one_line_and_starts_nothing(tmp_path, quick_profile,
                                                                                          ups):
    workdir = tmp_path / "cluster"
    spec = write_spec(tmp_path / "spec.yaml", quick_profile)
    first = ups(start_up(tmp_path, "--spec", str(spec), "--dir", str(workdir)))
    first.wait_serving()
    port = first.wait_line(r"^coordinator\s+http://127\.0\.0\.1:(\d+)")[1]
    before = _files(workdir)

    same_dir = _one_line_error(_second_up(tmp_path, "--spec", str(spec), "--dir", str(workdir), "--port", "0"))
    assert f"{workdir} is in use by another `cacheflow up` or `cacheflow demo` (pid {first.proc.pid})" in same_dir
    same_port = _one_line_error(_second_up(tmp_path, "--spec", str(spec), "--dir", str(tmp_path / "other"),
                                           "--port", port))
    assert f"port {port} (the coordinator's) is in use" in same_port
    assert not (tmp_path / "other").exists()

    after = _files(workdir)
    assert {p for p in after - before if p.suffix != ".log"} == set()  # no pod's token file, no chunk, no lock
    assert first.proc.poll() is None  # the first cluster serves on
