"""`cacheflow up`: the whole service on one machine, as local processes on loopback.

One cluster spec (YAML; every key optional) gives `pods` storage pods, `stages` stage workers and a
coordinator. Chunks live under `directory` (default: the cache directory's `cluster/`), so a second
`cacheflow up` restores what the first one stored. The client token is kept in `directory/api-tokens`
(created once); `cacheflow up` prints it with the coordinator's URL. One cluster at a time uses a
directory: `cacheflow up` holds `directory/up.lock` (`hold_workdir`) while it runs, and a supervised
cluster (`LocalCluster.supervise`) starts again each of its processes that exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import socket
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from cacheflow_common.auth import ensure_cluster_secrets
from cacheflow_common.errors import ConfigError
from cacheflow_common.layer_split import balanced_split
from cacheflow_common.model.sources import model_config
from cacheflow_common.tls import ensure_local_tls
from cacheflow_common.typed_values import typed_value
from cacheflow_services.coordinator.launch import LocalCoordinator, launch_coordinator
from cacheflow_services.storage.launch import LocalPod, launch_pod
from cacheflow_services.supervisor import RESTARTS_FILE, RestartPolicy, Service, Supervisor
from cacheflow_services.worker.launch import LocalWorker, launch_stages

LOCK_FILE = "up.lock"
MAX_PORT = 65535
SECRETS_DIR = "internal"  # the cluster's internal token and grant keys (cacheflow_common.auth), made once


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    model: str = "smollm2"  # tiny | smollm2 | a model directory
    stages: int = 2  # pipeline stages (one worker process each)
    pods: int = 2  # storage pods
    chunk_size: int = 256
    dtype: str = "auto"
    policy: str = "cacheflow"  # the default restore policy (a request may name another)
    profile: str = ""  # from `cacheflow profile` (`cacheflow up` measures one when none is given)
    backend: str = "filesystem"  # filesystem | memory | redis
    redis_url: str = ""
    directory: str = ""  # chunks, tokens and logs (default: <cache>/cluster)
    rate_gbps: float = 0.0  # shape each pod's link (0: unshaped)
    link_capacity_gbps: float = 0.0  # each pod's link capacity, for I/O utilisation (0: rate_gbps, else the NIC's)
    transport: str = "auto"  # data plane: auto (TCP, what the workers read over) | tcp | nixl (NIXL as well)
    port: int = 8000  # the coordinator's (0: any free one)
    max_batch: int = 8
    max_queue: int = 64
    batch_window_ms: float = 20.0
    tenant: str = "default"
    other_tenants: list[str] = field(default_factory=list)  # more tenants with tokens of their own
    tls: bool = False  # TLS on the internal hops (a CA and certificate made once in <directory>/internal/tls)
    threads_per_stage: int = 0  # torch threads per worker (0: this machine's cores shared evenly)
    stage_cpus: list[str] = field(default_factory=list)  # per stage, the CPUs its worker is pinned to ("0", "2,3")
    worker_args: list[str] = field(default_factory=list)  # extra `cacheflow worker` options

    @classmethod
    def load(cls, path: Path | None, **overrides: Any) -> ClusterSpec:
        """The spec in `path` (None: the defaults), with the non-None `overrides` applied."""
        data: dict[str, Any] = {}
        if path is not None:
            try:
                data = yaml.safe_load(path.read_text()) or {}
            except (OSError, yaml.YAMLError) as exc:
                raise ConfigError(f"cannot read cluster spec {path}: {exc}") from exc
            if not isinstance(data, dict):
                raise ConfigError(f"cluster spec {path} is not a mapping of options")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(data) - known):
            raise ConfigError(f"unknown cluster spec keys {unknown}; known: {sorted(known)}")
        hints = typing.get_type_hints(cls)
        try:
            data = {key: typed_value(hints[key], value, key) for key, value in data.items()}
        except ConfigError as exc:
            raise ConfigError(f"cluster spec {path}: {exc}") from None
        data.update({k: v for k, v in overrides.items() if v is not None})
        spec = cls(**data)
        if spec.stages < 1 or spec.pods < 1:
            raise ConfigError("a cluster needs at least one stage and one storage pod")
        if not 0 <= spec.port <= MAX_PORT:
            raise ConfigError(f"port must be 0 (any free one) to {MAX_PORT}, not {spec.port}")
        if spec.stage_cpus and len(spec.stage_cpus) != spec.stages:
            raise ConfigError(f"stage_cpus lists {len(spec.stage_cpus)} CPU sets for {spec.stages} stages")
        return spec

    def workdir(self, cache_dir: Path) -> Path:
        return Path(self.directory).expanduser() if self.directory else cache_dir / "cluster"

    def threads(self) -> int:
        """Torch threads per worker: `threads_per_stage`, or this machine's cores shared evenly."""
        return self.threads_per_stage or max(1, (os.cpu_count() or 1) // self.stages)


@dataclass
class LocalCluster:
    pods: list[LocalPod]
    workers: list[LocalWorker]
    coordinator: LocalCoordinator
    tenant: str
    token: str  # the client's bearer token
    supervisor: Supervisor | None = None

    def services(self) -> list[tuple[str, Service]]:
        """Every process, named as a person would: "coordinator", "stage 0", "pod 1"."""
        named: list[tuple[str, Service]] = [("coordinator", self.coordinator)]
        named += [(f"stage {w.stage}", w) for w in self.workers]
        named += [(f"pod {i}", p) for i, p in enumerate(self.pods)]
        return named

    def supervise(self, policy: RestartPolicy | None = None) -> Supervisor:
        """From now on, start again (same ports, same arguments) each process that exits."""
        self.supervisor = Supervisor(self.services(), policy,
                                     state_file=self.coordinator.log_path.parent / RESTARTS_FILE).start()
        return self.supervisor

    def stop(self) -> None:
        """Coordinator first (no new work), then workers (they flush their saves), then pods; nothing
        is restarted meanwhile."""
        if self.supervisor is not None:
            self.supervisor.pause()
        self.coordinator.stop()
        for w in self.workers:
            w.stop()
        for p in self.pods:
            p.stop()
        if self.supervisor is not None:
            self.supervisor.close()


@contextlib.contextmanager
def hold_workdir(workdir: Path) -> Iterator[None]:
    """Hold the cluster directory's lock (flock on `up.lock`) for the block: ConfigError, in one line
    naming the process that holds it, when another `cacheflow up` runs on this directory."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / LOCK_FILE, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            raise ConfigError(f"{workdir} is in use by another `cacheflow up` or `cacheflow demo` (pid {holder}): "
                              "stop it, or choose another directory (--dir, or `directory:` in the cluster spec)"
                              ) from None
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        yield  # closing the file releases the lock


def _token_file(path: Path, tenant: str) -> str:
    """The token of `tenant` in `path` ('tenant token' lines), created once and kept."""
    if path.is_file():
        for line in path.read_text().splitlines():
            name, _, token = line.partition(" ")
            if name == tenant and token:
                return token
    token = secrets.token_urlsafe(24)
    with open(path, "a") as f:
        os.chmod(path, 0o600)
        f.write(f"{tenant} {token}\n")
    return token


def preflight(spec: ClusterSpec) -> list[range]:
    """What can fail before any process starts: the model (SmolLM2 is converted here, once) and the
    coordinator's port. Returns the stages' layer ranges."""
    split = balanced_split(model_config(spec.model).num_layers, spec.stages)
    if spec.port:
        try:
            socket.create_server(("127.0.0.1", spec.port)).close()
        except OSError as exc:
            raise ConfigError(f"port {spec.port} (the coordinator's) is in use ({exc.strerror}): stop what listens "
                              "there, or choose another port (--port, or `port:` in the cluster spec)") from None
    return split


def _link_hint(spec: ClusterSpec) -> list[str]:
    """The workers are told the pods' shaped rate: their load-time predictions start from it."""
    return ["--link-gbps", str(spec.rate_gbps)] if spec.rate_gbps > 0 else []


def start_cluster(spec: ClusterSpec, workdir: Path) -> LocalCluster:
    """Check the spec (`preflight`), then start pods, then workers, then the coordinator; on any failure
    stop what started."""
    split = preflight(spec)
    workdir.mkdir(parents=True, exist_ok=True)
    pod_token_file, api_token_file = workdir / "pod-tokens", workdir / "api-tokens"
    pod_tokens = {t: _token_file(pod_token_file, t) for t in [spec.tenant, *spec.other_tenants]}
    token = _token_file(api_token_file, spec.tenant)
    for other in spec.other_tenants:
        _token_file(api_token_file, other)
    secrets = ensure_cluster_secrets(workdir / SECRETS_DIR)
    tls = ["--tls-dir", str(ensure_local_tls(secrets / "tls").ca.parent)] if spec.tls else []
    pods: list[LocalPod] = []
    workers: list[LocalWorker] = []
    try:
        for i in range(spec.pods):
            extra = ["--rate-gbps", str(spec.rate_gbps)] + (["--redis-url", spec.redis_url] if spec.redis_url else [])
            extra += ["--link-capacity-gbps", str(spec.link_capacity_gbps)] if spec.link_capacity_gbps else []
            pods.append(launch_pod(workdir / f"pod-{i}", *extra, *tls, backend=spec.backend,
                                   transport=spec.transport, tokens=pod_tokens))
        addresses = [f"pod-{i}=127.0.0.1:{p.data_port}" for i, p in enumerate(pods)]
        workers = launch_stages(workdir, split=split, pods=addresses, secrets=secrets, model=spec.model,
                                chunk_size=spec.chunk_size, dtype=spec.dtype, policy=spec.policy, profile=spec.profile,
                                threads=spec.threads(), cpus=spec.stage_cpus,
                                extra=[*spec.worker_args, *_link_hint(spec), *tls])
        extra = ["--max-batch", str(spec.max_batch), "--max-queue", str(spec.max_queue),
                 "--batch-window-ms", str(spec.batch_window_ms), "--policy", spec.policy,
                 "--restarts-file", str(workdir / RESTARTS_FILE), *tls]  # what the supervisor knows of restarts
        coordinator = launch_coordinator(workdir, stages=[w.url for w in workers], pods=addresses,
                                         pod_token_file=pod_token_file, token_file=api_token_file, secrets=secrets,
                                         model=spec.model,
                                         extra=extra, http_port=spec.port)
    except BaseException:
        for w in workers:
            w.stop()
        for p in pods:
            p.stop()
        raise
    return LocalCluster(pods, workers, coordinator, spec.tenant, token)
