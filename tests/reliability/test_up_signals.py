"""Every way out of `cacheflow up` and `cacheflow demo` stops the processes they started: SIGTERM while
starting, SIGTERM during `--demo`, SIGHUP while serving, and even SIGKILL (the children's parent-death
signal), restarted processes included; the coordinator's port is free afterwards (real processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from cacheflow_services.profiling import ensure_quick_profile
from tests.reliability.up_cluster import (
    Up,
    descendants,
    start_up,
    wait_gone,
    write_spec,
)

EXIT_S = 120.0  # generous: each process gets 10 s to stop before SIGKILL


def _port_free(port: int) -> bool:
    try:
        socket.create_server(("127.0.0.1", port)).close()
    except OSError:
        return False
    return True


def _up(tmp_path: Path, profile: Path, *extra: str) -> Up:
    spec = write_spec(tmp_path / "spec.yaml", profile)
    return start_up(tmp_path, "--spec", str(spec), "--dir", str(tmp_path / "cluster"), *extra)


def _assert_all_gone(up: Up, children: list[int], port: int = 0) -> None:
    assert children, up.output()
    assert wait_gone(children, EXIT_S) == [], f"left running: {children}\n{up.output()}"
    if port:
        assert _port_free(port), f"port {port} is still held"


def test_sigterm_while_starting_stops_what_already_started(tmp_path, quick_profile, ups):
    up = ups(_up(tmp_path, quick_profile))
    up.wait_line(r"worker \(stage 1\) ready on port")  # the pods and one worker run; the rest is starting
    children = descendants(up.proc.pid)
    up.proc.send_signal(signal.SIGTERM)
    code = up.proc.wait(EXIT_S)
    _assert_all_gone(up, children)
    assert code == 128 + signal.SIGTERM
    assert "cacheflow up: stopped by SIGTERM" in up.stderr() and "Traceback" not in up.stderr()


def test_sigterm_during_the_demo_stops_every_process_and_frees_the_port(tmp_path, quick_profile, ups):
    up = ups(_up(tmp_path, quick_profile, "--demo", "--demo-tokens", "2000"))
    port = int(up.wait_line(r"^coordinator\s+http://127\.0\.0\.1:(\d+)")[1])
    up.wait_line(r"^first \(prefill, then stored\) request")
    children = descendants(up.proc.pid)
    up.proc.send_signal(signal.SIGTERM)
    code = up.proc.wait(EXIT_S)
    _assert_all_gone(up, children, port)
    assert code == 128 + signal.SIGTERM, up.output()


def test_sighup_while_serving_stops_every_process_and_frees_the_port(tmp_path, quick_profile, ups):
    up = ups(_up(tmp_path, quick_profile))
    up.wait_serving()
    port = int(up.wait_line(r"^coordinator\s+http://127\.0\.0\.1:(\d+)")[1])
    children = descendants(up.proc.pid)
    up.proc.send_signal(signal.SIGHUP)  # the terminal it ran in was closed
    code = up.proc.wait(EXIT_S)
    _assert_all_gone(up, children, port)
    assert code == 0, up.output()


def test_a_killed_up_takes_its_processes_with_it_restarted_ones_included(tmp_path, quick_profile, ups):
    up = ups(_up(tmp_path, quick_profile))
    up.wait_serving()
    port = int(up.wait_line(r"^coordinator\s+http://127\.0\.0\.1:(\d+)")[1])
    os.kill(up.child(f"{up.workdir}/pod-0/"), signal.SIGKILL)
    up.wait_stderr("pod 0 is back")  # restarted by the supervisor's thread, not the main thread
    children = descendants(up.proc.pid)
    up.proc.kill()  # no handler, no finally: only the parent-death signal stops the children
    up.proc.wait(EXIT_S)
    _assert_all_gone(up, children, port)


def test_sigterm_to_cacheflow_demo_stops_its_cluster(tmp_path):
    cache = tmp_path / "cache"
    settings = {"chunk_size": 32, "max_tokens": 512}
    ensure_quick_profile(cache, "tiny", dtype="auto", threads=1, **settings)  # the demo's own profile, made here
    proc = subprocess.Popen([sys.executable, "-m", "cacheflow_services.cli", "demo", "--model", "tiny",
                             "--chunk-size", "32", "--max-tokens", "512", "--token-scale", "16", "--requests", "2",
                             "--out", str(tmp_path / "report")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "CACHEFLOW_CACHE": str(cache)})
    up = Up(proc, cache / "demo-cluster", tmp_path / "none")
    threading.Thread(target=up.read_stdout, daemon=True).start()
    try:
        up.wait_line(r"worker \(stage 1\) ready on port")
        children = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(EXIT_S)
        _assert_all_gone(up, children)
        assert code == 128 + signal.SIGTERM, up.output()
        assert any("cacheflow demo: stopped by SIGTERM" in line for line in up.lines), up.output()
    finally:
        up.stop()
