"""A stage worker's configuration (frozen; from the command line or the cluster spec)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cacheflow_common.engine import EngineSettings
from cacheflow_common.errors import ConfigError
from cacheflow_common.restore.profile import Profile
from cacheflow_common.sched.policies import POLICIES
from cacheflow_common.tls import TLSFiles
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_services.http_server import DEFAULT_LIMITS, ServerLimits


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    stage: int  # this worker's pipeline stage, 0-based
    layers: range  # the layers it owns, [a_s, b_s)
    last_stage: bool  # owns the final norm and LM head (samples the next token)
    model: str = "tiny"  # tiny | smollm2 | qwen3-8b | a model directory (same on every stage)
    dtype: str = "auto"
    chunk_size: int = 256  # the restore's chunk size (docs/architecture.md); the same on every stage
    pods: tuple[PodAddress, ...] = ()  # storage pods (placement by rendezvous hashing over them)
    # tenant -> bearer token for the pods, only where the engine is embedded for one tenant (the vLLM connector);
    # a served worker holds none: grants bring short-lived credentials (trust.py)
    pod_tokens: dict[str, str] = field(default_factory=dict)
    replicas: int = 1  # copies of each saved chunk
    next_stage: str = ""  # control URL of stage s+1 ("" on the last stage)
    policy: str = "cacheflow"  # restore policy; the CacheFlow ones need a profile
    profile: Path | None = None  # from `cacheflow profile`; without it the policy falls back to cake
    link_gbps: float | None = None  # each pod's link rate, if known: the profile's load costs behind it
    # The compute loop's token budget per step: restore units, suffix-prefill slices and decode tokens of
    # every request share it (one restore unit always fits). 2048 keeps a step near 0.1-0.3 s on 2 CPU
    # cores for small models, so decode tokens are not held up long by a batch of restores.
    step_tokens: int = 2048
    prefill_tokens: int = 2048  # compute-only recomputes in units this long (its fastest prefill here)
    # Restore tokens a step may carry beside forward work (suffix prefills, decodes); one unit always fits.
    # 0: forward work runs in light steps, so a restored request reaches its first token without waiting
    # for a full step of other requests' restores (on a CPU a step's time grows with its tokens).
    beside_forward_tokens: int = 0
    pool_tokens: int = 1 << 17  # KV pool capacity, tokens of this stage's layers
    block_tokens: int = 16  # the pool's allocation unit
    upstream_timeout_s: float = 30.0  # pipelined restore: longest wait for the previous stage's next chunk
    next_stage_timeout_s: float = 60.0  # a forward or delivery to the next stage
    tls: TLSFiles | None = None  # serve HTTPS; call the next stage and the pods over TLS (their CA)
    limits: ServerLimits = DEFAULT_LIMITS  # what the HTTP port holds for a client
    host: str = "127.0.0.1"
    http_port: int = 0
    max_request_tokens: int = 1 << 17  # longest prefix + suffix + new tokens one request may hold
    # No tenant holds more than this share of the pool at once: half by default, so that one tenant cannot take
    # the pool from a second (1.0: no cap, for a single tenant).
    tenant_pool_share: float = 0.5
    hold_ttl_s: float = 600.0  # a session unused this long is freed (above the coordinator's hold and stage timeout)
    typical_request_tokens: int = 4096  # /readyz is 503 while the pool has no room for a request this long

    def __post_init__(self) -> None:
        if self.stage < 0 or not len(self.layers) or self.layers.step != 1:
            raise ConfigError(f"stage {self.stage} with layers {self.layers}: need stage >= 0 and layers a:b, a < b")
        if self.last_stage == bool(self.next_stage):
            raise ConfigError("every stage but the last needs --next-stage (the last must not have one)")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if min(self.step_tokens, self.prefill_tokens) <= 0 or (self.link_gbps is not None and self.link_gbps <= 0):
            raise ConfigError("step and prefill token budgets and the link rate must be positive")
        if self.beside_forward_tokens < 0:
            raise ConfigError("the restore tokens beside forward work cannot be negative")
        if self.chunk_size <= 0 or self.block_tokens <= 0 or self.pool_tokens < self.block_tokens:
            raise ConfigError("chunk size, block size and pool size must be positive (pool >= one block)")
        if not self.pods:
            raise ConfigError("a worker needs storage pods (--pods)")
        if not 0 < self.tenant_pool_share <= 1 or self.hold_ttl_s <= 0 or self.typical_request_tokens <= 0:
            raise ConfigError("the tenant pool share must be in (0, 1]; the hold TTL and typical request positive")
        if not 1 <= self.replicas <= len(self.pods):
            raise ConfigError(f"{self.replicas} replicas over {len(self.pods)} storage pods")


def engine_settings(config: WorkerConfig, profile: Profile | None) -> EngineSettings:
    """The engine's view of a worker: its stage, layers, budgets, pods as channels, and the profile's costs
    behind the link rate it was told (`link_gbps`)."""
    link = None if config.link_gbps is None else config.link_gbps * 1e9 / 8
    return EngineSettings(layers=config.layers, stage=config.stage, pipeline=config.stage > 0 or not config.last_stage,
                          policy=config.policy, chunk_size=config.chunk_size, prefill_tokens=config.prefill_tokens,
                          step_tokens=config.step_tokens, beside_forward_tokens=config.beside_forward_tokens,
                          channels=tuple(address.pod_id for address in config.pods),
                          costs=profile.cost_model(link) if profile else None,
                          l_delta=profile.l_delta_for(link) if profile else 0)


def parse_layers(text: str) -> range:
    """"4:8" -> range(4, 8)."""
    start, sep, stop = text.partition(":")
    if not sep or not start.isdigit() or not stop.isdigit() or int(start) >= int(stop):
        raise ConfigError(f"layers {text!r}: expected a:b with a < b")
    return range(int(start), int(stop))
