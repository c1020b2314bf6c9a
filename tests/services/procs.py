"""Real processes for service tests: storage pods (`cacheflow storage`) and a `redis-server`, on loopback."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from cacheflow_services.local_process import free_port
from cacheflow_services.storage.launch import LocalPod as Pod
from cacheflow_services.storage.launch import launch_pod as start_pod

__all__ = ["Pod", "Redis", "redis_server", "start_pod"]


@dataclass
class Redis:
    port: int
    directory: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Redis:
        # appendonly with fsync per write: what a pod acknowledged survives a Redis restart.
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--dir", str(self.directory), "--appendonly", "yes", "--appendfsync", "always",
                                      "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def redis_server(tmp_path: Path) -> Redis:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (.ci/run installs it: apt-get install redis-server)")
    return Redis(free_port(), tmp_path).start()
