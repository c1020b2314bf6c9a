"""The connector's settings, from vLLM's `kv_connector_extra_config` (a JSON object)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cacheflow_common.errors import ConfigError
from cacheflow_common.sched.policies import POLICIES

ON_MISS = ("cacheflow", "vllm")
ATTENTION = ("vllm", "cacheflow")
RUNTIMES = ("vllm", "cacheflow")


@dataclass(frozen=True, kw_only=True)
class ConnectorConfig:
    pods: tuple[str, ...]  # storage pods, "id=host:port" (the same ids every client uses: placement hashes them)
    tenant: str  # keys are salted by tenant; the token must belong to it
    pod_token_file: str  # "tenant token" lines, as the pods read them; the line for `tenant` is used
    chunk_size: int = 256  # tokens per chunk, a multiple of vLLM's block size; equal to the cluster's to share chunks
    policy: str = "cacheflow"  # restore policy (sched.policies.POLICIES); "load-only" turns recomputation off
    profile: str = ""  # `cacheflow profile` output; without it the CacheFlow policies run as Cake (no cost model)
    link_gbps: float = 0.0  # the link the profile's costs are taken for; 0: the profile's own default
    calibrate: bool = True  # planned restores learn what loads and recompute really take; off: the profile's costs
    on_miss: str = "cacheflow"  # a chunk that misses: recomputed inside the restore, or handed to vLLM ("vllm")
    save: bool = True  # store the prompt's whole chunks as vLLM computes them
    replicas: int = 1  # copies of each chunk over the pods
    timeout_s: float = 5.0  # a dead pod turns reads into misses within this
    model: str = ""  # the model's directory (config.json + safetensors); default: the directory vLLM serves
    runtime: str = "vllm"  # recompute with vLLM's own model, or "cacheflow": CacheFlow's runtime (runtime.py)
    share_weights: bool = True  # CacheFlow's runtime over vLLM's loaded weights; off (or not covered): a copy
    batch_restores: bool = True  # a step's loads restored together by the batch engine; off: one after another
    async_loads: bool = True  # restore in the background while vLLM steps the rest of the batch; off: in the step
    front_step_tokens: int = 0  # a background restore's front recomputes at most this many tokens per vLLM step
    # (tensor-parallel ranks), vLLM's other requests stepping between; 0: as vLLM chunks a long prefill
    restore_timeout_s: float = 60.0  # a background restore still running after this is cancelled: vLLM recomputes
    draft_kv: bool = True  # store a speculative draft's KV with the chunks and load it (off: restores rerun the draft)
    attention: str = "vllm"  # CacheFlow's runtime attends with vLLM's CPU kernel over the blocks, or its own
    stats_file: str = ""  # append one JSON line per restore / save / load error (tests, benchmarks)

    def __post_init__(self) -> None:
        if not self.pods:
            raise ConfigError("the CacheFlow connector needs `pods` (a list of id=host:port)")
        if self.chunk_size <= 0:
            raise ConfigError(f"chunk_size must be positive, got {self.chunk_size}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.on_miss not in ON_MISS:
            raise ConfigError(f"on_miss must be one of {ON_MISS}, got {self.on_miss!r}")
        if self.runtime not in RUNTIMES:
            raise ConfigError(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        if self.attention not in ATTENTION:
            raise ConfigError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.front_step_tokens < 0:
            raise ConfigError(f"front_step_tokens must be 0 (vLLM's own per-step limit) or positive, got "
                              f"{self.front_step_tokens}")
        if self.restore_timeout_s <= 0:
            raise ConfigError(f"restore_timeout_s must be positive, got {self.restore_timeout_s}")

    @classmethod
    def from_extra(cls, extra: dict[str, Any], *, served_model: str) -> ConnectorConfig:
        """Settings from the extra config; unknown keys are refused (a typo must not pass silently)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"unknown CacheFlow connector settings {unknown}; known: {sorted(known)}")
        values = dict(extra)
        if isinstance(values.get("pods"), str):
            values["pods"] = values["pods"].split(",")
        values["pods"] = tuple(values.get("pods", ()))
        values.setdefault("model", served_model)
        for name in ("tenant", "pod_token_file"):
            if not values.get(name):
                raise ConfigError(f"the CacheFlow connector needs `{name}`")
        return cls(**values)

    def token(self) -> str:
        """The tenant's bearer token from `pod_token_file`."""
        path = Path(self.pod_token_file).expanduser()
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"cannot read pod_token_file {path}: {exc}") from exc
        for line in lines:
            parts = line.split()
            if len(parts) == 2 and parts[0] == self.tenant:
                return parts[1]
        raise ConfigError(f"{path} has no token for tenant {self.tenant!r}")
