"""Keep a local cluster's processes running: one that exits is started again, with backoff.

`cacheflow up` supervises its storage pods, stage workers and coordinator from one thread. A process
that exits (crashed, killed, out of memory) is started again with the same arguments on the same ports,
so a pod keeps its data directory and every process keeps the address the others know it by. The first
restart waits `first_delay_s`, each further one in a row twice as long (at most `max_delay_s`); after
`max_attempts` restarts in a row that did not last `healthy_after_s`, the supervisor gives up and says
why (`wait_failed`). Each exit and restart is logged with the process, its exit status and the attempt.

The thread that restarts the processes is their parent for the kernel's parent-death signal
(`local_process`): it lives until `close()`, which comes after the processes are stopped.

What it knows is published for the coordinator (`state_file`, JSON, replaced atomically on every
change): each process being restarted, from the moment its exit is seen until it serves again, with
its attempt and since when, or that the supervisor gave up on it; a process not listed is running. A
request waiting for a stage that is down waits longer while that stage is known to be restarting
(`restart_in_progress`), up to the coordinator's hard bound, instead of a fixed time. (On Kubernetes
the equivalent is a pod that exists but is not ready yet.)
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cacheflow_common.files import write_atomically
from cacheflow_services.local_process import STARTUP_S, ServiceStartError

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    first_delay_s: float = 0.5
    max_delay_s: float = 8.0
    max_attempts: int = 5  # restarts in a row (each lasting less than healthy_after_s) before giving up
    healthy_after_s: float = 60.0  # a process up this long counts its next restart from 1 again
    poll_s: float = 0.25  # how often the processes are looked at

    def delay_s(self, attempt: int) -> float:
        return min(self.max_delay_s, self.first_delay_s * 2 ** (attempt - 1))


RESTARTING, GAVE_UP = "restarting", "gave up"
RESTARTS_FILE = "restarts.json"  # the state file's name in a local cluster's directory


def restart_in_progress(state_file: Path, name: str) -> bool:
    """Whether the supervisor publishing `state_file` is restarting process `name` now (False when the file
    cannot be read: nothing is known)."""
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return False
    entry = state.get(name) if isinstance(state, dict) else None
    return isinstance(entry, dict) and entry.get("state") == RESTARTING


class Service(Protocol):
    """A local process that can be started again as it was: LocalPod, LocalWorker, LocalCoordinator."""

    proc: subprocess.Popen[str] | None
    log_path: Path

    def start(self) -> object: ...

    def stop(self) -> None: ...


@dataclass
class _Watched:
    name: str
    service: Service
    attempts: int = 0  # restarts in the current run of failures
    started: float = field(default_factory=time.monotonic)
    last_status: str = ""


def exit_status(code: int) -> str:
    """`status 1`, or `signal SIGKILL` for a process a signal ended (Popen's negative codes)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"status {code}"


class Supervisor:
    def __init__(self, services: Sequence[tuple[str, Service]], policy: RestartPolicy | None = None, *,
                 state_file: Path | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self._watched = [_Watched(name, service) for name, service in services]
        self.state_file = state_file
        self._states: dict[str, dict[str, object]] = {}  # name -> what is published about it
        self._stopping = threading.Event()  # no more restarts
        self._closed = threading.Event()  # the thread may end
        self._gave_up = threading.Event()
        self.failed = ""  # why the supervisor gave up ("" while it has not)
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._publish()  # every process running: a file left by an earlier run says nothing wrong
        self._thread.start()
        return self

    def _set_state(self, name: str, state: str | None, attempt: int = 0) -> None:
        """Publish that process `name` is restarting or given up (None: running again)."""
        if state is None:
            self._states.pop(name, None)
        else:
            since = self._states.get(name, {}).get("since", time.time())
            self._states[name] = {"state": state, "attempt": attempt, "since": since}
        self._publish()

    def _publish(self) -> None:
        if self.state_file is None:
            return
        try:
            write_atomically(self.state_file, json.dumps(self._states))
        except OSError as exc:
            log.warning("could not publish the restart state in %s: %s", self.state_file, exc)

    def wait_failed(self, timeout_s: float) -> str:
        """Why the supervisor gave up, once it has ("" if it has not within `timeout_s`)."""
        self._gave_up.wait(timeout_s)
        return self.failed

    def pause(self) -> None:
        """Restart nothing from now on (the cluster is stopping); a restart under way finishes and is
        stopped again."""
        self._stopping.set()

    def close(self) -> None:
        """End the thread, after the processes were stopped (`pause` first)."""
        self._stopping.set()
        self._closed.set()
        self._thread.join(STARTUP_S + 30)

    def _run(self) -> None:
        while not self._closed.wait(self.policy.poll_s):
            for watched in self._watched:
                if self._stopping.is_set():
                    break
                self._check(watched)

    def _check(self, watched: _Watched) -> None:
        proc = watched.service.proc
        if proc is None:
            return
        code = proc.poll()
        if code is None:
            if watched.attempts and time.monotonic() - watched.started >= self.policy.healthy_after_s:
                watched.attempts = 0
            return
        if watched.attempts >= self.policy.max_attempts:
            self._give_up(watched)
            return
        if not watched.last_status:
            watched.last_status = exit_status(code)
            log.warning("%s (pid %d) exited with %s", watched.name, proc.pid, watched.last_status)
        self._set_state(watched.name, RESTARTING, watched.attempts + 1)
        self._restart(watched)

    def _restart(self, watched: _Watched) -> None:
        watched.attempts += 1
        attempt = f"attempt {watched.attempts} of {self.policy.max_attempts}"
        delay = self.policy.delay_s(watched.attempts)
        log.warning("restarting %s in %.1f s (%s)", watched.name, delay, attempt)
        if self._stopping.wait(delay):
            return
        try:
            watched.service.start()
        except ServiceStartError as exc:
            log.warning("%s did not come back (%s): %s", watched.name, attempt, exc)
            return
        watched.started, watched.last_status = time.monotonic(), ""
        self._set_state(watched.name, None)
        if self._stopping.is_set():  # the cluster began to stop while this one started
            watched.service.stop()
            return
        pid = watched.service.proc.pid if watched.service.proc is not None else 0
        log.warning("%s is back (pid %d, %s)", watched.name, pid, attempt)

    def _give_up(self, watched: _Watched) -> None:
        if self._gave_up.is_set():
            return
        self.failed = (f"{watched.name} exited again after {watched.attempts} restarts in a row "
                       f"(last: {watched.last_status}); gave up restarting it (its log: {watched.service.log_path})")
        log.error("%s", self.failed)
        self._set_state(watched.name, GAVE_UP, watched.attempts)
        self._gave_up.set()
