"""`cacheflow up` as a real subprocess (tiny model, a quick profile made once per session), and the
processes it starts, read from /proc: what the reliability tests of `cacheflow up` drive."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml

from cacheflow_services.profiling import ensure_quick_profile

CHUNK = 32
UP_S = 180.0  # generous: `cacheflow up` starts 5 processes that import torch, on 2 busy cores


def tiny_profile(directory: Path) -> Path:
    """A quick profile of the tiny model (seconds): given in the spec, so `cacheflow up` profiles nothing."""
    return ensure_quick_profile(directory, "tiny", dtype="float32", chunk_size=CHUNK, max_tokens=8 * CHUNK,
                                threads=1)


def write_spec(path: Path, profile: Path, **overrides: object) -> Path:
    spec = {"model": "tiny", "chunk_size": CHUNK, "dtype": "float32", "profile": str(profile), "port": 0,
            "transport": "tcp", "threads_per_stage": 1, "max_batch": 4, "batch_window_ms": 10, **overrides}
    path.write_text(yaml.safe_dump(spec))
    return path


@dataclass
class Up:
    """A running `cacheflow up`: its stdout lines as they come, its stderr in a file."""

    proc: subprocess.Popen[str]
    workdir: Path
    stderr_path: Path
    lines: list[str] = field(default_factory=list)

    def read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_line(self, pattern: str, timeout_s: float = UP_S) -> re.Match[str]:
        """The first stdout line matching `pattern` (fails if `cacheflow up` exits or it does not come)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.proc.poll() is not None:
                time.sleep(0.5)  # the reader may still hold the last lines
                if any(re.search(pattern, line) for line in self.lines):
                    continue
                pytest.fail(f"`cacheflow up` exited ({self.proc.returncode}) before {pattern!r}:\n{self.output()}")
            time.sleep(0.1)
        pytest.fail(f"no {pattern!r} from `cacheflow up` within {timeout_s:.0f} s:\n{self.output()}")

    def wait_serving(self) -> None:
        self.wait_line(r"^serving\b")

    @property
    def url(self) -> str:
        return self.wait_line(r"^coordinator\s+(http://\S+)")[1]

    @property
    def token(self) -> str:
        return self.wait_line(r"^\s+token\s+(\S+)")[1]

    def client(self, timeout_s: float = 120.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}, timeout=timeout_s)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""

    def wait_stderr(self, text: str, timeout_s: float = UP_S) -> str:
        """Its stderr (its log lines) once it holds `text`."""
        deadline = time.monotonic() + timeout_s
        while text not in (err := self.stderr()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert text in err, f"no {text!r} in the stderr of `cacheflow up`:\n{self.output()}"
        return err

    def output(self) -> str:
        return "\n".join(self.lines) + "\n--- stderr ---\n" + self.stderr()

    def child(self, marker: str) -> int:
        """The pid of the process `cacheflow up` started whose command line holds `marker`."""
        for pid in descendants(self.proc.pid):
            if marker in cmdline(pid):
                return pid
        pytest.fail(f"no child of `cacheflow up` runs {marker!r}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL; then any process left that runs in its directory is killed (a failed
        test leaves nothing behind)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for pid in _ppids():
            if f"{self.workdir}/" in cmdline(pid) and alive(pid):
                os.kill(pid, signal.SIGKILL)


def start_up(tmp_path: Path, *args: str, name: str = "up") -> Up:
    """`cacheflow up *args` in the background (its cache directory under tmp_path)."""
    env = {**os.environ, "CACHEFLOW_CACHE": str(tmp_path / "cache")}
    stderr_path = tmp_path / f"{name}.stderr"
    with open(stderr_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "cacheflow_services.cli", "up", *args], stdout=subprocess.PIPE,
                                stderr=err, text=True, env=env)
    workdir = Path(args[args.index("--dir") + 1]) if "--dir" in args else tmp_path / "cache" / "cluster"
    up = Up(proc, workdir, stderr_path)
    threading.Thread(target=up.read_stdout, daemon=True).start()
    return up


@contextlib.contextmanager
def stopped_after() -> Iterator[Callable[[Up], Up]]:
    """Register each started `cacheflow up`: all of them are stopped after the block, whatever happened."""
    started: list[Up] = []

    def register(up: Up) -> Up:
        started.append(up)
        return up

    try:
        yield register
    finally:
        for up in started:
            up.stop()


def _ppids() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return parents


def descendants(pid: int) -> list[int]:
    parents = _ppids()
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """The pids still alive after at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]
