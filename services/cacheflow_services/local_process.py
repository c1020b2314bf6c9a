"""Start a `cacheflow` service as a local process and wait until it serves (tests, benchmarks, one-machine runs).

A service prints one JSON line when it is ready (its ports); `start_service` waits for that line and
then for its HTTP API to answer /healthz. A service that does not get there raises ServiceStartError,
one line naming the service, why, and its log. Inside `reporting_ready(callback)`, every service that
becomes ready is told to `callback` (what `cacheflow up` prints while the cluster starts).

On Linux every service is started with a parent-death signal (SIGTERM, armed by a tiny Python
stub that then execs the service): if the process that started it dies, however it dies, the service
stops too instead of holding its ports. The kernel sends that signal when the *thread* that started
the service ends, so start services only from threads that live as long as the services should (the
main thread, or a supervisor's own thread). Inside `exit_on_signals()`, SIGTERM, SIGINT and SIGHUP
raise `Stopped` in the main thread, so that the `finally` blocks which stop the services run
whichever way a command is stopped.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from cacheflow_common.errors import CacheFlowError
from cacheflow_common.tls import TLSFiles

STARTUP_S = 90.0  # a service imports torch and fastapi (and may load a model): seconds on a busy machine
ReadyCallback = Callable[[str, dict[str, Any], float], None]  # (service, its ready line, seconds it took)
_on_ready: ContextVar[ReadyCallback | None] = ContextVar("on_ready", default=None)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_received: list[int] = []  # the stop signals received inside `exit_on_signals`
# Run in the new process before the service: arm PR_SET_PDEATHSIG (1), give up if the parent is already
# gone, then exec the service. A stub rather than a preexec_fn: no Python runs between fork and exec.
DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                   "ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)\n"
                   "if os.getppid() != int(sys.argv[1]):\n    os._exit(1)\n"
                   "os.execvp(sys.argv[2], sys.argv[2:])")


class ServiceStartError(CacheFlowError):
    """A local service exited or did not answer before it was ready; the message names its log."""


class Stopped(KeyboardInterrupt):
    """A stop signal arrived (inside `exit_on_signals`): unwind, stopping what was started on the way."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """Inside the block (main thread only), SIGTERM, SIGINT and SIGHUP raise `Stopped` (a second one
    during the cleanup cuts it short: the services still get their parent-death signal). The previous
    handlers come back after the block."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        _received.append(signum)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    _received.clear()
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        _received.clear()


def raise_if_stopped() -> None:
    """In the main thread, raise `Stopped` if a stop signal came inside `exit_on_signals` (call it
    where no stop is being handled): a handler's exception is lost where Python ignores exceptions
    (finalizers, fork hooks), and this brings it back."""
    if _received and threading.current_thread() is threading.main_thread():
        raise Stopped(_received[-1])


def die_with_parent() -> list[str]:
    """The command prefix that gives a service this process as its parent for the parent-death signal
    (none where prctl is not available)."""
    if not sys.platform.startswith("linux"):
        return []
    return [sys.executable, "-S", "-c", DIE_WITH_PARENT, str(os.getpid())]


@contextlib.contextmanager
def reporting_ready(callback: ReadyCallback) -> Iterator[None]:
    """Tell `callback` of every service `start_service` brings up inside this block."""
    token = _on_ready.set(callback)
    try:
        yield
    finally:
        _on_ready.reset(token)


def print_ready(service: str, ready: dict[str, Any], seconds: float) -> None:
    """A `reporting_ready` callback: one line per service as it is ready."""
    print(f"  {service} ready on port {ready['http_port']} ({seconds:.1f} s)", flush=True)


def service_name(args: Sequence[str]) -> str:
    """`cacheflow <args>` in a few words: "storage", "worker (stage 1)", "coordinator"."""
    name = args[0] if args else "?"
    if "--stage" in args[:-1]:
        name += f" (stage {args[list(args).index('--stage') + 1]})"
    return name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_service(args: list[str], log_path: Path, *, prefix: Sequence[str] = ()
                  ) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Run `cacheflow <args>` (behind `prefix`, e.g. taskset); returns the process and its ready line
    once its API answers (ServiceStartError if it exits or does not answer first). Interrupted while
    it waits (a stop signal), it stops the process first."""
    began = time.monotonic()
    with open(log_path, "a") as log_file:  # stderr to a file: an unread pipe would block a chatty service
        proc = subprocess.Popen([*die_with_parent(), *prefix, sys.executable, "-m", "cacheflow_services.cli", *args],
                                stdout=subprocess.PIPE, stderr=log_file, text=True)
    try:
        ready = _wait_ready(proc, args, log_path)
        raise_if_stopped()
    except BaseException:
        stop_process(proc)
        raise
    if callback := _on_ready.get():
        callback(service_name(args), ready, time.monotonic() - began)
    return proc, ready


def _wait_ready(proc: subprocess.Popen[str], args: list[str], log_path: Path) -> dict[str, Any]:
    """The service's ready line, once its API answers."""
    assert proc.stdout is not None
    line = " "
    while line and not line.startswith("{"):  # the ready line (a native library may print before it)
        line = proc.stdout.readline()
    if not line:
        code = proc.wait(STARTUP_S)
        raise ServiceStartError(f"`cacheflow {service_name(args)}` exited (status {code}) before it was ready: "
                                f"{last_line(log_path)} (its log: {log_path})")
    ready: dict[str, Any] = json.loads(line)
    tls = TLSFiles.in_dir(args[args.index("--tls-dir") + 1]) if ready.get("tls") else None  # the API serves TLS
    try:
        wait_http(f"{'https' if tls else 'http'}://127.0.0.1:{ready['http_port']}/healthz",
                  verify=tls.client_context() if tls else True)
    except ServiceStartError as exc:
        raise ServiceStartError(f"`cacheflow {service_name(args)}`: {exc} (its log: {log_path})") from None
    return ready


def last_line(log_path: Path) -> str:
    """The last non-empty line of a log (a failed command's error, or an exception's last line)."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1] if lines else "nothing logged"


def wait_http(url: str, verify: Any = True) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)  # not up yet, or up but not ready
    raise ServiceStartError(f"{url} did not answer within {STARTUP_S:.0f} s")


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


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, every thread) process `pid` has used, from the kernel's accounting."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (stat fields 14, 15)


def idle_cpu_share(pids: Sequence[int], seconds: float) -> list[float]:
    """The share of one core each of `pids` uses over `seconds` (measured together)."""
    before, began = [cpu_seconds(p) for p in pids], time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - began
    return [(cpu_seconds(p) - b) / wall for p, b in zip(pids, before, strict=True)]
