"""The client of `fork_server.py`: start one fork server per interpreter, on first use, and run modules through it
as child processes of their own (`ForkServer.run`, as subprocess would run `python -P -m MODULE ARGS`).

A server that does not start (its imports fail, or it does not listen within START_S) is not retried: the
caller falls back to fresh processes, and the server's log says why. The server ends when this process does
(its standard input, a pipe from here, closes).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Collection, Sequence
from pathlib import Path

from cacheflow_services.vllm_connector.fork_server import read_line

log = logging.getLogger(__name__)
SERVER_MODULE = "cacheflow_services.vllm_connector.fork_server"
START_S = 300.0  # vLLM's imports take 12 s on a 2-core CPU; a loaded one may take far longer
KILLED = -1  # run's answer for a child killed at its timeout


class ForkServer:
    def __init__(self, python: Path, env: dict[str, str], preload: Sequence[str]) -> None:
        self.python = python
        self.env = dict(env)
        self.folder = Path(tempfile.mkdtemp(prefix="cacheflow-fork-"))
        self.socket_path = str(self.folder / "socket")
        self.log_path = self.folder / "server.log"
        with self.log_path.open("w") as server_log:
            self.proc = subprocess.Popen([str(python), "-P", "-m", SERVER_MODULE, self.socket_path, *preload],
                                         stdin=subprocess.PIPE, stdout=server_log, stderr=subprocess.STDOUT,
                                         cwd=self.folder, env=env)

    def wait_ready(self, timeout_s: float = START_S) -> bool:
        """Whether the server listens (False: it exited, or is still importing after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if os.path.exists(self.socket_path):
                return True
            time.sleep(0.1)
        return False

    def serves(self, env: dict[str, str], per_run: Collection[str]) -> bool:
        """Whether a run in `env` can fork from this server: the same environment as the server's but for the
        variables in `per_run` (read as the run works, not as modules are imported: a variable the imports read,
        such as HF_HUB_CACHE, would keep the server's value)."""
        def fixed(variables: dict[str, str]) -> dict[str, str]:
            return {name: value for name, value in variables.items() if name not in per_run}
        return fixed(env) == fixed(self.env)

    def run(self, module: str, args: Sequence[str], cwd: Path, env: dict[str, str], log_path: Path,
            timeout_s: float | None) -> int:
        """Run `module` in a forked child, appending its output to `log_path`; its exit status (negative: the
        signal that ended it), or KILLED once its process group was killed at `timeout_s`."""
        request = {"module": module, "args": list(args), "cwd": str(cwd), "env": env, "log": str(log_path)}
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.socket_path)
            conn.sendall(json.dumps(request).encode() + b"\n")
            pending = bytearray()
            pid = _number(read_line(conn, pending))
            conn.settimeout(timeout_s)
            try:
                return _number(read_line(conn, pending))
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.killpg(pid, signal.SIGKILL)  # the run and any process it started
                conn.settimeout(None)
                read_line(conn, pending)  # the server reaped it
                return KILLED

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def _number(line: str) -> int:
    """A pid or an exit status the server sent."""
    if not line:
        raise RuntimeError("the fork server went away before it answered")
    return int(line)


_servers: dict[str, ForkServer | None] = {}  # interpreter -> its server (None: it did not start)
_lock = threading.Lock()


def shared_server(python: Path, env: dict[str, str], preload: Sequence[str]) -> ForkServer | None:
    """This process's fork server for `python` (started on first use, with `env` and `preload`), or None where
    it did not start."""
    with _lock:
        if str(python) not in _servers:
            _servers[str(python)] = _started(ForkServer(python, env, preload))
        return _servers[str(python)]


def _started(server: ForkServer) -> ForkServer | None:
    if server.wait_ready():
        atexit.register(server.close)
        return server
    log.warning("no fork server for %s (fresh processes instead): %s", server.python,
                server.log_path.read_text(errors="replace")[-2000:])
    server.close()
    return None
