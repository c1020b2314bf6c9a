"""Start stage workers as local processes: for tests, benchmarks and one-machine runs.

`launch_stages` starts the last stage first, so that each worker is given the URL of the one after it.
With `cores`, each worker is pinned to its own CPU cores (taskset) and runs that many torch threads.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cacheflow_common.auth import INTERNAL_TOKEN_FILE, VERIFY_KEY_FILE, GrantIssuer, read_secret
from cacheflow_common.tls import TLSFiles
from cacheflow_services.local_process import start_service, stop_process


@dataclass
class LocalWorker:
    stage: int
    args: list[str]
    log_path: Path
    cpus: str = ""  # taskset CPU list, e.g. "0" or "2,3"
    proc: subprocess.Popen[str] | None = None
    http_port: int = 0

    def start(self) -> LocalWorker:
        """Start (or restart, on the same port) the worker and wait until it serves."""
        port = ["--http-port", str(self.http_port)] if self.http_port else []
        pin = ["taskset", "-c", self.cpus] if self.cpus and shutil.which("taskset") else []
        self.proc, ready = start_service(["worker", *self.args, *port], self.log_path, prefix=pin)
        self.http_port = ready["http_port"]
        return self

    @property
    def tls(self) -> TLSFiles | None:
        return TLSFiles.in_dir(self.args[self.args.index("--tls-dir") + 1]) if "--tls-dir" in self.args else None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.http_port}"

    @property
    def internal_headers(self) -> dict[str, str]:
        """The internal token this worker was started with (every `/v1` call carries it, and a grant)."""
        path = self.args[self.args.index("--internal-token-file") + 1]
        return {"Authorization": f"Bearer {read_secret(path, 'internal token file').decode()}"}

    def issuer(self, pod_tokens: dict[str, str] | None = None) -> GrantIssuer:
        """The coordinator's credentials for this worker's cluster (the signing key lies beside the token)."""
        secrets = Path(self.args[self.args.index("--internal-token-file") + 1]).parent
        return GrantIssuer.from_dir(secrets, pod_tokens or {})

    def granted_headers(self, op: str, **grant: Any) -> dict[str, str]:
        """The headers of one call to this worker: the internal token and a fresh grant for `op` here
        (`GrantIssuer.issue`'s other arguments), as the coordinator would send them (tests, benchmarks)."""
        return self.issuer().headers_for(op, stages=[self.stage], **grant)

    def flush(self, timeout_s: float = 600.0) -> None:
        """Wait until every chunk the worker computed so far is stored (`POST /v1/flush`, granted as the
        coordinator would grant it, over TLS where the worker serves it)."""
        tls = self.tls
        httpx.post(f"{self.url}/v1/flush", headers=self.granted_headers("flush"), timeout=timeout_s,
                   verify=tls.client_context() if tls else True).raise_for_status()

    def kill(self) -> None:
        stop_process(self.proc, kill=True)

    def stop(self) -> None:
        stop_process(self.proc)


def launch_stages(workdir: Path, *, split: Sequence[range], pods: Sequence[str], secrets: Path,
                  model: str = "tiny", chunk_size: int = 256, dtype: str = "float32", policy: str = "cake",
                  profile: str = "", cpus: Sequence[str] = (), threads: int = 1,
                  extra: Sequence[str] = ()) -> list[LocalWorker]:
    """One worker per stage of `split`, chained; returns them in stage order. `secrets`: the cluster's internal
    secrets (`cacheflow_common.auth.ensure_cluster_secrets`): workers get the internal token and the grant
    verifying key, never a tenant's storage token."""
    workdir.mkdir(parents=True, exist_ok=True)
    workers: list[LocalWorker] = []
    next_url = ""
    try:
        for stage in reversed(range(len(split))):
            layers = split[stage]
            args = ["--stage", str(stage), "--layers", f"{layers.start}:{layers.stop}", "--model", model,
                    "--dtype", dtype, "--chunk-size", str(chunk_size), "--pods", ",".join(pods),
                    "--internal-token-file", str(secrets / INTERNAL_TOKEN_FILE),
                    "--grant-key-file", str(secrets / VERIFY_KEY_FILE), "--policy", policy, "--threads", str(threads),
                    *extra]
            args += ["--next-stage", next_url] if next_url else []
            args += ["--profile", profile] if profile else []
            worker = LocalWorker(stage, args, workdir / f"worker-{stage}.log", cpus=cpus[stage] if cpus else "")
            workers.insert(0, worker.start())
            next_url = worker.url
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers
