"""Start the coordinator as a local process: for tests, benchmarks and `cacheflow up`."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cacheflow_common.auth import INTERNAL_TOKEN_FILE, SIGNING_KEY_FILE
from cacheflow_services.local_process import start_service, stop_process


@dataclass
class LocalCoordinator:
    args: list[str]
    log_path: Path
    proc: subprocess.Popen[str] | None = None
    http_port: int = 0

    def start(self) -> LocalCoordinator:
        port = ["--http-port", str(self.http_port)] if self.http_port else []
        self.proc, ready = start_service(["coordinator", *self.args, *port], self.log_path)
        self.http_port = ready["http_port"]
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stop(self) -> None:
        stop_process(self.proc)


def launch_coordinator(workdir: Path, *, stages: Sequence[str], pods: Sequence[str], pod_token_file: Path,
                       token_file: Path, secrets: Path, model: str = "tiny", extra: Sequence[str] = (),
                       http_port: int = 0) -> LocalCoordinator:
    """`secrets`: the cluster's internal secrets (`cacheflow_common.auth.ensure_cluster_secrets`), as the
    workers were given them."""
    workdir.mkdir(parents=True, exist_ok=True)
    args = ["--stages", ",".join(stages), "--pods", ",".join(pods), "--pod-token-file", str(pod_token_file),
            "--token-file", str(token_file), "--internal-token-file", str(secrets / INTERNAL_TOKEN_FILE),
            "--grant-signing-key-file", str(secrets / SIGNING_KEY_FILE), "--model", model, *extra]
    return LocalCoordinator(args, workdir / "coordinator.log", http_port=http_port).start()
