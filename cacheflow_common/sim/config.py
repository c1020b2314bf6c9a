"""What a simulation runs: the model's shape, the cluster (stages, channels, link) and the policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cacheflow_common.errors import ConfigError
from cacheflow_common.layer_split import balanced_split
from cacheflow_common.restore.costs import CostModel
from cacheflow_common.restore.profile import Profile
from cacheflow_common.sched.policies import POLICIES

if TYPE_CHECKING:  # importing the model package loads torch; the simulator needs only the numbers
    from cacheflow_common.model.config import ModelConfig

PLACEMENTS = ("round-robin", "hash")
SCHEDULINGS = ("per-stage", "cluster")  # as the workers' engines do, or one idealised cluster-wide scheduler


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The numbers of a model the simulator needs: its depth and its KV bytes per token per layer."""

    num_layers: int
    kv_bytes_per_token_layer: int  # 2 (K and V) * kv_heads * head_dim * dtype bytes

    @classmethod
    def of(cls, config: ModelConfig, dtype: str = "") -> ModelShape:
        """The shape of `config`, its KV held in `dtype` (default: the config's own)."""
        from cacheflow_common.model.config import DTYPE_BYTES

        per_token = 2 * config.num_kv_heads * config.head_dim * DTYPE_BYTES[dtype or config.dtype]
        return cls(num_layers=config.num_layers, kv_bytes_per_token_layer=per_token)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    model: ModelShape
    costs: CostModel  # per-layer compute costs and the store's own load rate (a profile's `costs`)
    policy: str = "cacheflow"
    n_stages: int = 1
    n_channels: int = 1  # storage pods; each serves one load at a time
    link_gbps: float | None = 10.0  # per channel; None: the cost model's load rate alone
    chunk_size: int = 256  # tokens per restore chunk (docs/architecture.md)
    prefill_tokens: int = 2048  # compute-only recomputes in units this long, as a worker's engine does
    l_delta: int = 0  # token-wise iff the prefix has >= l_delta tokens (adaptive policies only)
    max_batch: int = 64  # requests admitted at once (restore to first token); later arrivals queue in order
    batch_window_s: float = 0.0  # a batch forms this long after its first request arrived (or when full)
    restore_overhead_s: float = 0.0  # per restore, between the pointers meeting and the suffix prefill (RPCs)
    batched_compute: bool = True  # a stage's step pays the shared fixed cost once, as a worker's engine does;
    # False: every unit pays its own (workers that compute request by request)
    max_batch_tokens: int | None = None  # a step's token budget (the engine's step_tokens; one unit always fits)
    beside_forward_tokens: int | None = None  # restore tokens a step carries beside prefill work (the engine's;
    # one unit always fits); None: no such cap
    compute_slowdown_while_loading: float = 1.0  # a step that starts while loads are in flight takes this
    # much longer (a host whose loaders and pods share cores with the compute loops; fitted from a lone
    # restore that computes and loads at once); 1.0: compute and I/O on separate hardware, as on a GPU
    placement: str = "round-robin"  # which channel holds a unit: "round-robin" (even) or "hash"
    scheduling: str = "per-stage"  # each stage schedules its own units with a loader per pod of its own
    # (as the workers' engines do); "cluster": one idealised scheduler over every stage, one loader per pod
    stage_layers: tuple[int, ...] = field(default=())  # layers per stage; () = an even split

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.scheduling not in SCHEDULINGS:
            raise ConfigError(f"unknown scheduling {self.scheduling!r}; choose one of {', '.join(SCHEDULINGS)}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(f"unknown placement {self.placement!r}; choose one of {', '.join(PLACEMENTS)}")
        if (min(self.n_stages, self.n_channels, self.max_batch, self.chunk_size) <= 0
                or min(self.batch_window_s, self.restore_overhead_s) < 0 or self.compute_slowdown_while_loading < 1):
            raise ConfigError("stages, channels, max batch and chunk size must be positive, "
                              "the batch window and restore overhead not negative, the slowdown at least 1")
        if not 1 <= self.n_stages <= self.model.num_layers:
            raise ConfigError(f"cannot split {self.model.num_layers} layers into {self.n_stages} stages")
        if self.stage_layers and (len(self.stage_layers) != self.n_stages or min(self.stage_layers) <= 0
                                  or sum(self.stage_layers) != self.model.num_layers):
            raise ConfigError(f"stage_layers {self.stage_layers} must give each of {self.n_stages} stages "
                              f"at least one of the {self.model.num_layers} layers")

    @classmethod
    def from_profile(cls, profile: Profile, *, model: ModelShape, link_gbps: float | None = 10.0,
                     **options: Any) -> SimConfig:
        """The profile's costs and the L_delta it measured nearest this link rate."""
        rate = None if link_gbps is None else link_gbps * 1e9 / 8
        return cls(model=model, costs=profile.costs, link_gbps=link_gbps, l_delta=profile.l_delta_for(rate),
                   **options)

    def link_costs(self) -> CostModel:
        """The cost model with each channel's link limit applied."""
        return self.costs.with_link(None if self.link_gbps is None else self.link_gbps * 1e9 / 8)

    def layer_split(self) -> tuple[int, ...]:
        """Layers per stage: as given, or the split the stage workers use (as even as possible)."""
        if self.stage_layers:
            return self.stage_layers
        return tuple(len(r) for r in balanced_split(self.model.num_layers, self.n_stages))


def balanced_link_gbps(costs: CostModel, shape: ModelShape, *, n_stages: int, n_channels: int, tokens: int,
                       ratio: float = 1.0) -> float:
    """Per-channel rate at which a stage's loads take `ratio` times its compute (all stages loading at once)."""
    layers = shape.num_layers // n_stages
    compute_s = costs.chunk_compute_s(0, tokens, layers)
    stage_bytes = tokens * layers * shape.kv_bytes_per_token_layer
    return stage_bytes * n_stages / n_channels / (compute_s * ratio) * 8 / 1e9
