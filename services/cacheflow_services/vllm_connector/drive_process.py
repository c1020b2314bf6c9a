"""Run `drive.py` (prompts through vLLM, with or without the connector) in a fresh process of vLLM's own
Python, as the tests and benches do: the spec written beside its log, vLLM's CPU settings for a short run,
one core per rank, and on a timeout the whole process group killed (a rank left waiting on a failed one
spins a core until vLLM's RPC timeout).

Imports nothing of vLLM: it runs in CacheFlow's environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cacheflow_services.vllm_connector.fork_client import KILLED, shared_server

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"  # created by .ci/run
TIMED_OUT = "timed out after"  # the line a timeout adds to the log
DRIVE_MODULE = "cacheflow_services.vllm_connector.drive"
# what the fork server imports: most of what a run imports (12 of its 20 s on a 2-core CPU, 3 more to tear down)
PRELOAD = ("vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.worker.cpu_worker",
           "cacheflow_services.vllm_connector.connector")
# a run's variables that may differ from the fork server's: read as vLLM's engine starts, or not by vLLM at all
# (pytest names the running test in PYTEST_CURRENT_TEST)
PER_RUN_ENV = ("VLLM_CPU_KVCACHE_SPACE", "PYTEST_CURRENT_TEST")
LOG_TAIL_CHARS = 4000


@dataclass(frozen=True)
class DriveRun:
    name: str
    result: dict[str, Any] | None  # what drive.py wrote; None when it failed or timed out
    log: str
    returncode: int  # KILLED: killed at the timeout

    def checked(self) -> dict[str, Any]:
        """What drive.py wrote, or RuntimeError with the log's tail."""
        if self.result is None:
            raise RuntimeError(f"vLLM run {self.name!r} failed ({self.returncode}):\n{self.log[-LOG_TAIL_CHARS:]}")
        return self.result


def vllm_env(ranks: int = 1, *, kv_space_gib: int = 1) -> dict[str, str]:
    """vLLM's process: a fixed KV space (its start-up fails without one here), no Hub, the engine in the
    driver's process; this checkout's CacheFlow ahead of any installed copy. With several ranks (TP x PP),
    one core each (on one NUMA node vLLM's CPU build refuses to place more than one worker by itself), ranks
    sharing cores where there are more ranks than cores (slow, but it runs)."""
    path = os.pathsep.join([str(REPO / "services"), str(REPO), os.environ.get("PYTHONPATH", "")])
    cores = sorted(os.sched_getaffinity(0))
    binding = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cores[rank % len(cores)]) for rank in range(ranks))
               } if ranks > 1 else {}
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": path, **binding}


def run_drive(spec: dict[str, Any], workdir: Path, name: str, *, timeout_s: float | None = None,
              kv_space_gib: int = 1, python: Path = VLLM_PYTHON) -> DriveRun:
    """drive.py over `spec` in a fresh vLLM process, in `workdir` (`name`.spec.json, .out.json, .log there).
    `-P`: the working folder stays off sys.path. A run in one process (one rank) of vLLM's own Python forks
    from a process that has imported vLLM (`fork_client.py`), but for a run that measures its memory or one
    whose environment differs from that process's (beyond PER_RUN_ENV)."""
    spec_path, out_path, log_path = (workdir / f"{name}{suffix}" for suffix in (".spec.json", ".out.json", ".log"))
    spec_path.write_text(json.dumps({**spec, "out": str(out_path)}))
    out_path.unlink(missing_ok=True)
    log_path.write_text("")
    env = vllm_env(_ranks(spec), kv_space_gib=kv_space_gib)
    server = shared_server(python, vllm_env(), PRELOAD) if forks(spec, python) else None
    if server is not None and server.alive and server.serves(env, PER_RUN_ENV):
        returncode = server.run(DRIVE_MODULE, [str(spec_path)], workdir, env, log_path, timeout_s)
    else:
        returncode = _spawn([str(python), "-P", "-m", DRIVE_MODULE, str(spec_path)], workdir, env, log_path,
                            timeout_s)
    if returncode == KILLED:
        with log_path.open("a") as log:
            log.write(f"\n{TIMED_OUT} {timeout_s:g} s\n")
    result = json.loads(out_path.read_text()) if returncode == 0 and out_path.exists() else None
    return DriveRun(name, result, log_path.read_text(errors="replace"), returncode)


def forks(spec: dict[str, Any], python: Path) -> bool:
    """Whether a run may fork from the fork server: vLLM's own Python, one rank (several start their own rank
    workers, each bound to its cores as it starts), and not a run that measures its own memory."""
    return python == VLLM_PYTHON and _ranks(spec) == 1 and not spec.get("memory")


def _ranks(spec: dict[str, Any]) -> int:
    return int(spec.get("tensor_parallel_size", 1) * spec.get("pipeline_parallel_size", 1))


def _spawn(argv: list[str], workdir: Path, env: dict[str, str], log_path: Path, timeout_s: float | None) -> int:
    """A fresh process in its own session; its exit status, or KILLED once its group is killed."""
    with log_path.open("a") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True,
                                env=env)
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its rank workers too
            proc.wait()
            return KILLED
