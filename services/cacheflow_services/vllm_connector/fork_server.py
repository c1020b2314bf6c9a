"""A fork server for short runs of vLLM's Python: one process imports vLLM once (12 s of imports on a 2-core
CPU, more than a test's whole run on a tiny model) and forks a child per run, which runs its module as
`python -P -m MODULE ARGS` would, in its own session, working folder, environment and log. A child starts with
the modules imported and nothing else done (no engine, no model, no thread of vLLM's): everything a run does
happens in it, and it exits as a process does (threads joined, exit handlers run, output flushed), but for
the interpreter's teardown of every module (`exit_now`).

    python -P -m cacheflow_services.vllm_connector.fork_server SOCKET [MODULE ...]

imports the MODULEs, listens on the Unix socket SOCKET and serves until its standard input closes (the client
that started it went away). A connection sends one JSON line, {"module", "args", "cwd", "env", "log"}, and is
answered two lines: the child's pid (its process group too), then its exit status as subprocess reports one
(negative: the signal that ended it). Standard library only: it runs in vLLM's environment.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import threading
import traceback
from typing import Any

REQUEST_TIMEOUT_S = 10.0  # a client sends its request at once


def main(argv: list[str]) -> None:
    path, preload = argv[0], argv[1:]
    for name in preload:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"{path}.binding")
    listener.listen()
    os.rename(f"{path}.binding", path)  # the path appears once it listens
    request = serve(listener)  # returns in a forked child only
    run_child(request)


def serve(listener: socket.socket) -> dict[str, Any]:
    """Fork a child per request and report its pid and exit status; return the request in the child."""
    wake_r, wake_w = os.pipe()  # SIGCHLD writes here (set_wakeup_fd): select wakes when a child exits
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection waiting for its exit status
    while True:
        readable, _, _ = select.select([listener, sys.stdin, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
        _report_exits(waiting)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 4096):  # the client is gone
            sys.exit(0)
        if listener in readable:
            conn, _ = listener.accept()
            conn.settimeout(REQUEST_TIMEOUT_S)
            request = json.loads(read_line(conn))
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.set_wakeup_fd(-1)
                for fd in (listener, conn, *waiting.values()):
                    fd.close()
                os.close(wake_r)
                os.close(wake_w)
                return dict(request)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn


def _report_exits(waiting: dict[int, socket.socket]) -> None:
    while waiting:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):  # the client gave up on it
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def read_line(conn: socket.socket, buffer: bytearray | None = None) -> str:
    """One line from `conn` (without its newline; "" if it closed first). `buffer`: bytes read past earlier
    lines, kept for the next call; the socket's timeout applies to each read."""
    pending = bytearray() if buffer is None else buffer
    while b"\n" not in pending:
        data = conn.recv(4096)
        if not data:
            return ""
        pending += data
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return line.decode()


def run_child(request: dict[str, Any]) -> None:
    """Become the run: a session of its own, its folder, environment and log, then its module as __main__."""
    os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    null = os.open(os.devnull, os.O_RDONLY)
    for source, target in ((null, 0), (log, 1), (log, 2)):
        os.dup2(source, target)
    os.close(log)
    os.close(null)
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_now(code)


def _exit_code(code: object) -> int:
    """What the interpreter makes of `sys.exit(code)`."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def exit_now(code: int) -> None:
    """Exit as the interpreter does (its other threads joined but daemons, exit handlers run, output flushed),
    without tearing down the thousands of modules a vLLM process holds one by one (3 s on a 2-core CPU, for
    memory the process hands back as it ends anyway)."""
    # the interpreter's own first step: thread pools told to end (their workers are not daemons), then every
    # thread that is not a daemon joined
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
