"""The launcher the vLLM tests and benches share (`drive_process.py`): a run's result and log, its environment,
and on a timeout the whole process group killed. Its interpreter here is a small script standing in for
vLLM's Python (what it runs is the launcher's business, not vLLM's): the real vLLM runs go through the same
launcher in every other test of this folder."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from cacheflow_services.vllm_connector.drive_process import (
    PER_RUN_ENV,
    TIMED_OUT,
    VLLM_PYTHON,
    forks,
    run_drive,
    vllm_env,
)

STAND_IN = f"""#!{sys.executable}
import json, os, subprocess, sys, time
spec = json.loads(open(sys.argv[-1]).read())
print("args", sys.argv[1:4], "bind", os.environ.get("VLLM_CPU_OMP_THREADS_BIND"), flush=True)
if spec.get("child"):  # a rank worker of its own, as vLLM's multiprocess executor starts
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(spec["child"], "w").write(str(child.pid))
time.sleep(spec.get("sleep", 0))
if spec.get("fail"):
    sys.exit("ValueError: " + spec["fail"])
open(spec["out"], "w").write(json.dumps({{"results": [{{"tokens": [1, 2]}}]}}))
"""


@pytest.fixture
def stand_in(tmp_path: Path) -> Path:
    path = tmp_path / "python"
    path.write_text(STAND_IN)
    path.chmod(0o755)
    return path


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie is gone but for its parent


def test_a_run_returns_what_drive_wrote_and_its_log(stand_in: Path, tmp_path: Path) -> None:
    run = run_drive({"tensor_parallel_size": 2, "pipeline_parallel_size": 1}, tmp_path, "ok", python=stand_in,
                    timeout_s=30)
    assert run.returncode == 0 and run.checked() == {"results": [{"tokens": [1, 2]}]}
    binding = vllm_env(2)["VLLM_CPU_OMP_THREADS_BIND"]  # a core per rank
    assert f"args ['-P', '-m', 'cacheflow_services.vllm_connector.drive'] bind {binding}" in run.log
    assert json.loads((tmp_path / "ok.spec.json").read_text())["out"] == str(tmp_path / "ok.out.json")


def test_a_failed_run_raises_with_its_log_when_checked(stand_in: Path, tmp_path: Path) -> None:
    (tmp_path / "failed.out.json").write_text("{}")  # an earlier run's result is not taken for this one's
    run = run_drive({"fail": "no kernel"}, tmp_path, "failed", python=stand_in, timeout_s=30)
    assert run.result is None and run.returncode == 1
    with pytest.raises(RuntimeError) as raised:
        run.checked()
    message = str(raised.value)
    assert message.startswith("vLLM run 'failed' failed (1):\n") and "ValueError: no kernel" in message


def test_a_timeout_kills_the_whole_process_group(stand_in: Path, tmp_path: Path) -> None:
    child = tmp_path / "child.pid"
    started = time.monotonic()
    run = run_drive({"sleep": 60, "child": str(child)}, tmp_path, "hung", python=stand_in, timeout_s=3)
    assert time.monotonic() - started < 30
    assert run.result is None and run.returncode == -1 and run.log.rstrip().endswith(f"{TIMED_OUT} 3 s")
    pid = int(child.read_text())
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:  # SIGKILL is delivered, then init reaps the orphan
        time.sleep(0.05)
    assert not alive(pid)


def test_ranks_get_a_core_each_and_share_them_when_too_few(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    env = vllm_env(1, kv_space_gib=2)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    cores = sorted(os.sched_getaffinity(0))
    ranks = len(cores) + 1  # one more rank than cores: the first core takes two
    assert vllm_env(ranks)["VLLM_CPU_OMP_THREADS_BIND"].split("|") == [str(c) for c in cores + cores[:1]]


def test_the_runs_of_every_test_fork_from_one_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """What differs between two tests' runs (pytest's name of the test, a run's KV space) is read per run, so
    both fork from the server the first started (`fork_client.ForkServer.serves`)."""
    first = vllm_env()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/vllm/another.py::test (call)")
    second = vllm_env(1, kv_space_gib=2)
    assert {name for name in {*first, *second} if first.get(name) != second.get(name)} <= set(PER_RUN_ENV)


def test_only_one_rank_runs_of_vllms_python_that_measure_no_memory_fork(stand_in: Path) -> None:
    assert forks({}, VLLM_PYTHON) and forks({"tensor_parallel_size": 1, "pipeline_parallel_size": 1}, VLLM_PYTHON)
    assert not forks({"tensor_parallel_size": 2}, VLLM_PYTHON) and not forks({"pipeline_parallel_size": 2}, VLLM_PYTHON)
    assert not forks({"memory": True}, VLLM_PYTHON)  # vllm_memory compares real starts
    assert not forks({}, stand_in)  # another interpreter: it runs as given
