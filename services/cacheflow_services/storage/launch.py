"""Start storage pods as local processes (`cacheflow storage`): for tests, benchmarks and one-machine runs.

A pod prints one JSON line when ready (its ports and transport); `LocalPod.start` waits for it and
for the control API to answer, then hands out clients bound to the pod's tenants.
"""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cacheflow_common.transport.pod_client import PodAddress, PodClient
from cacheflow_services.local_process import start_service, stop_process


def write_tokens(path: Path, tenants: list[str]) -> dict[str, str]:
    """A token file with one fresh token per tenant; returns tenant -> token."""
    tokens = {t: secrets.token_urlsafe(24) for t in tenants}
    path.write_text("".join(f"{t} {tok}\n" for t, tok in tokens.items()))
    return tokens


@dataclass
class LocalPod:
    args: list[str]
    tokens: dict[str, str]  # tenant -> token
    log_path: Path
    proc: subprocess.Popen[str] | None = None
    data_port: int = 0
    http_port: int = 0
    transport: str = ""
    clients: list[PodClient] = field(default_factory=list)

    def start(self) -> LocalPod:
        """Start (or restart, on the same ports) the pod and wait until it serves."""
        ports = ["--data-port", str(self.data_port), "--http-port", str(self.http_port)] if self.data_port else []
        self.proc, ready = start_service(["storage", *self.args, *ports], self.log_path)
        self.data_port, self.http_port = ready["data_port"], ready["http_port"]
        self.transport = ready["transport"]
        return self

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def address(self, pod_id: str = "") -> PodAddress:
        return PodAddress(pod_id or f"pod-{self.data_port}", "127.0.0.1", self.data_port)

    def client(self, tenant: str = "alpha", *, timeout_s: float = 5.0, pod_id: str = "",
               nixl: object = None) -> PodClient:
        c = PodClient(self.address(pod_id), self.tokens[tenant], timeout_s=timeout_s, nixl=nixl)
        self.clients.append(c)
        return c

    def headers(self, tenant: str = "alpha") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[tenant]}"}

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs, as when a node dies."""
        stop_process(self.proc, kill=True)

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        stop_process(self.proc)


def launch_pod(workdir: Path, *extra: str, backend: str = "filesystem",
               tenants: tuple[str, ...] = ("alpha", "beta"), transport: str = "tcp",
               tokens: dict[str, str] | None = None) -> LocalPod:
    """A pod on loopback with a fresh token per tenant (or `tokens`, tenant -> token, shared by several
    pods); the filesystem backend keeps chunks in workdir/chunks."""
    workdir.mkdir(parents=True, exist_ok=True)
    token_file = workdir / f"tokens-{secrets.token_hex(4)}"
    if tokens is None:
        tokens = write_tokens(token_file, list(tenants))
    else:
        token_file.write_text("".join(f"{t} {tok}\n" for t, tok in tokens.items()))
    args = ["--backend", backend, "--token-file", str(token_file), "--transport", transport, *extra]
    if backend == "filesystem" and "--dir" not in extra:
        args += ["--dir", str(workdir / "chunks")]
    return LocalPod(args, tokens, workdir / "pod.log").start()
