"""The fork server the vLLM runs start from (`fork_server.py`, `fork_client.py`): each run a child of its own, in its
folder, environment, log and session, with its exit status, its threads and exit handlers finished, killed with its
whole process group at a timeout, runs side by side, and the server gone with its client. The server runs here in
CacheFlow's own Python, preloading a small module instead of vLLM (what it imports is the caller's business); the
real vLLM runs go through it in every other test of this folder that drives vLLM with one rank."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheflow_services.vllm_connector.fork_client import KILLED, ForkServer, _started

STAND_IN = """
import atexit, os, signal, subprocess, sys, threading, time
from pathlib import Path
how = sys.argv[1]
leader = os.getpgid(0) == os.getpid()
print("argv", sys.argv[1:], "cwd", os.getcwd(), "mark", os.environ.get("RUN_MARK"), "leader", leader, flush=True)
print("to stderr", file=sys.stderr)
if how == "exit":
    sys.exit(3)
if how == "raise":
    raise ValueError("no kernel")
if how == "signal":
    os.kill(os.getpid(), signal.SIGTERM)
if how == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    Path(sys.argv[2]).write_text(str(child.pid))
    time.sleep(60)
if how == "finish":
    from concurrent.futures import ThreadPoolExecutor
    pool = ThreadPoolExecutor(2)  # left with an idle worker, as vLLM's runs leave theirs
    pool.submit(print, "pooled").result()
    atexit.register(lambda: Path(sys.argv[2]).with_suffix(".atexit").write_text("ran"))
    threading.Thread(target=lambda: (time.sleep(0.5), Path(sys.argv[2]).write_text("joined"))).start()
if how == "meet":  # wait for the other run: both must be running at once
    Path(sys.argv[2]).write_text("here")
    deadline = time.monotonic() + 30
    while not Path(sys.argv[3]).exists():
        if time.monotonic() > deadline:
            sys.exit(4)
        time.sleep(0.05)
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ForkServer]:
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "stand_in.py").write_text(STAND_IN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(modules), *sys.path])}
    started = _started(ForkServer(Path(sys.executable), env, ["json"]))
    assert started is not None
    yield started
    started.close()


def run(server: ForkServer, tmp_path: Path, *args: str, timeout_s: float | None = 60) -> tuple[int, str]:
    log = tmp_path / f"{args[0]}.log"
    env = {**os.environ, "RUN_MARK": args[0]}
    code = server.run("stand_in", args, tmp_path, env, log, timeout_s)
    return code, log.read_text()


def test_a_run_is_its_module_in_its_folder_environment_session_and_log(server: ForkServer, tmp_path: Path) -> None:
    code, log = run(server, tmp_path, "plain", "x")
    assert code == 0
    assert f"argv ['plain', 'x'] cwd {tmp_path} mark plain leader True" in log and "to stderr" in log


def test_a_run_reports_its_exit_status(server: ForkServer, tmp_path: Path) -> None:
    assert run(server, tmp_path, "exit")[0] == 3
    code, log = run(server, tmp_path, "raise")
    assert code == 1 and "ValueError: no kernel" in log and "Traceback" in log
    assert run(server, tmp_path, "signal")[0] == -signal.SIGTERM


def test_a_run_ends_after_its_threads_and_exit_handlers(server: ForkServer, tmp_path: Path) -> None:
    mark = tmp_path / "thread"
    code, log = run(server, tmp_path, "finish", str(mark))
    assert code == 0 and "pooled" in log
    assert mark.read_text() == "joined" and mark.with_suffix(".atexit").read_text() == "ran"


def test_a_timeout_kills_the_runs_whole_process_group(server: ForkServer, tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    started = time.monotonic()
    assert run(server, tmp_path, "hang", str(child), timeout_s=3)[0] == KILLED
    assert time.monotonic() - started < 30
    pid = int(child.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the run's own child outlived the timeout"
        time.sleep(0.05)


def test_runs_go_side_by_side(server: ForkServer, tmp_path: Path) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    codes: list[int] = []
    other = threading.Thread(target=lambda: codes.append(run(server, tmp_path, "meet", str(second), str(first))[0]))
    other.start()
    codes.append(run(server, tmp_path, "meet", str(first), str(second))[0])
    other.join()
    assert codes == [0, 0]


def test_the_server_ends_with_its_client(server: ForkServer) -> None:
    assert server.proc.stdin is not None
    server.proc.stdin.close()  # as when the process that started it ends
    assert server.proc.wait(timeout=10) == 0 and not server.alive


def test_a_server_that_cannot_start_is_not_used(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert _started(ForkServer(Path(sys.executable), dict(os.environ), ["no_such_module_here"])) is None
    assert "no_such_module_here" in caplog.text


def test_a_run_forks_only_in_the_servers_environment_but_for_per_run_variables(server: ForkServer) -> None:
    assert server.serves(dict(server.env), ())
    changed = {**server.env, "HF_HUB_CACHE": "/elsewhere"}  # read as huggingface_hub is imported
    assert not server.serves(changed, ()) and server.serves(changed, ("HF_HUB_CACHE",))
    assert not server.serves({k: v for k, v in server.env.items() if k != "PYTHONPATH"}, ())
