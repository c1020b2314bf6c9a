"""What the scheduler knows about a request before its restore starts: per stage, per unit, the
predicted compute and load seconds and the storage channel the unit's KV is read from.

A unit is a token chunk (token mode: the stage's layers over `chunk_size` tokens) or a layer (layer
mode: one of the stage's layers over the whole prefix). `build_plan` derives every number from the
cost model, so the policy ranks requests and the simulator times them with the same predictions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from cacheflow_common.errors import ConfigError
from cacheflow_common.restore.costs import CostModel

NOT_STORED = -1  # a unit's load channel when storage does not hold it: it must be computed
MODES = ("token", "layer")

# (stage, unit) -> the channel (storage pod index) holding the unit's KV, or NOT_STORED
Placement = Callable[[int, int], int]


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One request's restore units on one stage."""

    n_layers: int  # layers of this stage
    compute_s: tuple[float, ...]  # predicted seconds to compute each unit alone
    fixed_s: tuple[float, ...]  # the part of compute_s a batch pays once (per-layer launch costs)
    load_s: tuple[float, ...]  # predicted seconds to load each unit (latency + bytes / rate)
    load_channel: tuple[int, ...]  # the channel each unit loads from; NOT_STORED: compute it
    tokens: tuple[int, ...]  # tokens each unit's compute processes (for batch token caps)

    def __post_init__(self) -> None:
        lengths = {len(self.compute_s), len(self.fixed_s), len(self.load_s), len(self.load_channel), len(self.tokens)}
        if len(lengths) != 1:
            raise ConfigError(f"stage plan lists differ in length: {sorted(lengths)}")

    @property
    def n_units(self) -> int:
        return len(self.compute_s)


@dataclass(frozen=True, kw_only=True)
class RequestPlan:
    """One request's restore: its mode and its units on every stage."""

    request_id: str
    arrival_s: float
    mode: str  # "token" | "layer"
    n_tokens: int  # cached prefix length
    stages: tuple[StagePlan, ...]

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown restore mode {self.mode!r}; choose one of {', '.join(MODES)}")

    def unit_tokens(self, stage: int, unit: int) -> float:
        """How many prefix tokens' worth of KV (over all layers) restoring this unit produces."""
        plan = self.stages[stage]
        layers = plan.n_layers if self.mode == "token" else 1
        return plan.tokens[unit] * layers / sum(s.n_layers for s in self.stages)


def chunk_costs(costs: CostModel, start: int, end: int, n_layers: int) -> tuple[float, float]:
    """(seconds, the batch-shared fixed part) to run `n_layers` layers over tokens [start, end)."""
    return costs.chunk_compute_s(start, end, n_layers), n_layers * costs.chunk_compute.fixed_s


def build_plan(
    *,
    request_id: str,
    arrival_s: float,
    n_tokens: int,
    costs: CostModel,
    stage_layers: Sequence[int],
    chunk_size: int,
    mode: str,
    kv_bytes_per_token_layer: int,
    place: Placement,
) -> RequestPlan:
    """The plan of a request with an `n_tokens` cached prefix over stages of `stage_layers` layers each.

    `mode` "token": units are chunks of `chunk_size` tokens; "layer": units are the stages' layers.
    """
    if chunk_size <= 0:
        raise ConfigError(f"chunk size must be positive, got {chunk_size}")
    chunks = [(a, min(a + chunk_size, n_tokens)) for a in range(0, n_tokens, chunk_size)]
    stages = []
    for s, n_layers in enumerate(stage_layers):
        if mode == "token":
            units = _token_units(costs, chunks, n_layers, kv_bytes_per_token_layer)
        else:
            units = _layer_units(costs, n_tokens, len(chunks), n_layers, kv_bytes_per_token_layer)
        channels = tuple(place(s, u) for u in range(len(units.tokens)))
        stages.append(StagePlan(n_layers=n_layers, compute_s=units.compute_s, fixed_s=units.fixed_s,
                                load_s=units.load_s, load_channel=channels, tokens=units.tokens))
    return RequestPlan(request_id=request_id, arrival_s=arrival_s, mode=mode, n_tokens=n_tokens, stages=tuple(stages))


@dataclass(frozen=True)
class _UnitCosts:
    compute_s: tuple[float, ...]
    fixed_s: tuple[float, ...]
    load_s: tuple[float, ...]
    tokens: tuple[int, ...]


def _token_units(costs: CostModel, chunks: list[tuple[int, int]], n_layers: int, kv_bytes: int) -> _UnitCosts:
    """Units are chunks: each runs the stage's layers over its tokens, or loads them for every layer."""
    compute = [chunk_costs(costs, a, b, n_layers) for a, b in chunks]
    return _UnitCosts(
        compute_s=tuple(c for c, _ in compute),
        fixed_s=tuple(f for _, f in compute),
        load_s=tuple(costs.chunk_load_s((b - a) * n_layers * kv_bytes) for a, b in chunks),
        tokens=tuple(b - a for a, b in chunks),
    )


def _layer_units(costs: CostModel, n_tokens: int, n_chunks: int, n_layers: int, kv_bytes: int) -> _UnitCosts:
    """Units are layers: each runs over the whole prefix, or loads its section of every chunk."""
    if n_tokens == 0:
        return _UnitCosts((), (), (), ())
    return _UnitCosts(
        compute_s=(costs.layer_compute_s(n_tokens),) * n_layers,
        fixed_s=(costs.layer_compute.fixed_s,) * n_layers,
        load_s=(costs.layer_load_s(n_tokens * kv_bytes, n_chunks),) * n_layers,
        tokens=(n_tokens,) * n_layers,
    )
