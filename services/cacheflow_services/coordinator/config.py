"""The restore coordinator's configuration (frozen; from the command line or the cluster spec)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cacheflow_common.errors import ConfigError
from cacheflow_common.sched.policies import POLICIES
from cacheflow_common.tls import TLSFiles
from cacheflow_common.transport.pod_client import PodAddress


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    stages: tuple[str, ...]  # control URLs of the stage workers, in stage order
    pods: tuple[PodAddress, ...]  # storage pods' data planes (the workers' placement, to look prefixes up)
    pod_tokens: dict[str, str]  # tenant -> bearer token for the storage pods
    api_tokens: dict[str, str]  # client bearer token -> tenant
    internal_token: str = field(repr=False)  # every call to a stage worker carries it
    grant_signing_key: bytes = field(repr=False)  # Ed25519 private key (PEM): signs each request's grants
    model_name: str = "tiny"  # the name clients pass as "model"
    tokenizer: Path | None = None  # a directory with tokenizer.json (and chat template); None: token ids only
    replicas: int = 1  # as the workers store chunks
    policy: str = "cacheflow"  # the restore policy of a request that names none
    batch_window_s: float = 0.02  # a batch forms within this window after its first request ...
    max_batch: int = 8  # ... or once this many wait; also the most restoring at once
    max_queue: int = 64  # requests waiting beyond the running batch; more are answered 429
    max_new_tokens: int = 4096  # the largest max_tokens a request may ask for
    stage_timeout_s: float = 300.0  # one call to a stage worker (a restore of a long prefix included)
    health_interval_s: float = 2.0  # how often workers and pods are probed
    stage_wait_s: float = 30.0  # a request waits this long for a stage that is down (restarting) before a 503 ...
    stage_restart_wait_s: float = 180.0  # ... or, while the supervisor says it is restarting it, up to this long
    restarts_file: Path | None = None  # the supervisor's restart state (`cacheflow up`); None: nothing known
    held_restore_s: float = 60.0  # a restore's KV held on the workers for a later completion, then freed
    max_held_restores: int = 16  # per tenant: restores queued, running or held at once (more: 429)
    max_body_bytes: int = 8 << 20  # the largest request body accepted (larger: 413)
    slot_stuck_s: float = 900.0  # every batch slot held longer than this: not ready (a slot's restore and first
    #                              token take a few stage calls of at most stage_timeout_s each)
    tls: TLSFiles | None = None  # the cluster CA, to trust the workers and pods (https:// stage URLs) with
    host: str = "127.0.0.1"
    http_port: int = 0

    def __post_init__(self) -> None:
        if not self.stages:
            raise ConfigError("the coordinator needs the stage workers' URLs (--stages)")
        if not self.pods or not self.pod_tokens:
            raise ConfigError("the coordinator needs the storage pods (--pods) and their tokens (--pod-token-file)")
        if not self.internal_token or not self.grant_signing_key:
            raise ConfigError("the coordinator needs the cluster's internal token (--internal-token-file) and grant "
                              "signing key (--grant-signing-key-file): workers serve nothing without them")
        if not self.api_tokens:
            raise ConfigError("the coordinator needs client tokens (--token-file): it serves no request without one")
        positive = min(self.max_batch, self.max_new_tokens, self.max_held_restores) > 0
        if not positive or self.max_queue < 0 or self.batch_window_s < 0:
            raise ConfigError("max batch, max new tokens and max held restores must be positive, queue and window "
                              "not negative")
        if self.max_body_bytes <= 0 or self.slot_stuck_s <= 0 or self.stage_wait_s < 0:
            raise ConfigError("the body limit and the stuck-slot bound must be positive, the stage wait not negative")
        if not 1 <= self.replicas <= len(self.pods):
            raise ConfigError(f"{self.replicas} replicas over {len(self.pods)} storage pods")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
