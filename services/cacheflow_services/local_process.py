"""Start a `cacheflow` service as a local process and wait until it serves (tests, benchmarks, one-machine runs).

A service prints one JSON line when it is ready (its ports); `start_service` waits for that line and
then for its HTTP API to answer /healthz.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

STARTUP_S = 90.0  # a service imports torch and fastapi (and may load a model): seconds on a busy machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_service(args: list[str], log_path: Path, *, prefix: Sequence[str] = ()
                  ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Run `cacheflow <args>` (behind `prefix`, e.g. taskset); returns the process and its ready line
    once its API answers."""
    with open(log_path, "a") as log:  # stderr to a file: an unread pipe would block a chatty service
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "cacheflow_services.cli", *args],
                                stdout=subprocess.PIPE, stderr=log, text=True)
    assert proc.stdout is not None
    line = " "
    while line and not line.startswith("{"):  # the ready line (a native library may print before it)
        line = proc.stdout.readline()
    if not line:
        proc.wait(STARTUP_S)
        raise RuntimeError(f"`cacheflow {args[0]}` failed to start: {log_path.read_text()[-2000:]}")
    ready: dict[str, Any] = json.loads(line)
    wait_http(f"http://127.0.0.1:{ready['http_port']}/healthz")
    return proc, ready


def wait_http(url: str) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.05)
    raise RuntimeError(f"{url} did not answer")


def stop_process(proc: subprocess.Popen[str] | None, *, kill: bool = False) -> None:
    """SIGTERM (SIGKILL after 10 s, or at once with `kill`: no shutdown path runs, as when a node dies)."""
    if proc is None or proc.poll() is not None:
        return
    if not kill:
        proc.terminate()
        try:
            proc.wait(10)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.kill()
    proc.wait(10)
