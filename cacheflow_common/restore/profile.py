"""The machine profile `cacheflow profile` writes: fitted costs and the measured L_delta crossover.

A profile is a small JSON file, loaded at start. `L_delta` (the prefix length from which token-wise
restore beats layer-wise) depends on the hardware and on the link, so the profile keeps one crossover
per profiled link rate; `l_delta_for(rate)` takes the one nearest in log scale.

A profile names what it measured (the model's fingerprint, the compute dtype, the device) and is
refused for anything else; its costs must not fall as length grows, and it records the measurements
the profiler had to take again because they did.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from cacheflow_common.errors import ConfigError
from cacheflow_common.files import write_atomically
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost

if TYPE_CHECKING:
    from cacheflow_common.model.transformer import Transformer

PROFILE_FORMAT = 2  # 2: the device, the monotonicity checks, fingerprints over every weight byte


@dataclass(frozen=True, kw_only=True)
class Crossover:
    """Measured restore times of both modes at one link rate, and the crossover length L_delta."""

    link_bytes_per_s: float
    l_delta: int
    table: tuple[dict[str, float], ...] = ()  # rows: n_tokens, token_s, layer_s


class MeasuredFor(TypedDict):
    """What a profile was measured for, as `Profile` names it."""

    model: str  # the model's fingerprint
    dtype: str
    device: str


@dataclass(frozen=True, kw_only=True)
class MonotoneCheck:
    """Measured times of one series that must not fall as length grows, and what it took."""

    what: str  # the series, e.g. "layer compute vs length"
    remeasured: int = 0  # points measured again because a longer one was faster
    monotone: bool = True  # after the re-measurements


@dataclass(frozen=True, kw_only=True)
class Profile:
    model: str  # model fingerprint
    model_name: str
    dtype: str  # the compute dtype measured
    device: str = "cpu"  # the device measured: "cpu", or "cuda (<GPU name>)"
    chunk_size: int
    threads: int
    costs: CostModel
    crossovers: tuple[Crossover, ...]
    machine: dict[str, Any] = field(default_factory=dict)
    checks: tuple[MonotoneCheck, ...] = ()  # the measured series checked for monotonicity

    def check_fits(self, model: Transformer, *, source: str = "the profile") -> None:
        """ConfigError unless this profile was measured for `model`'s weights, dtype and device."""
        from cacheflow_common.restore.measured import measured_as  # torch's side: only with a model at hand

        theirs = measured_as(model)
        pairs = {"model": (self.model, theirs["model"]), "dtype": (self.dtype, theirs["dtype"]),
                 "device": (self.device, theirs["device"])}
        wrong = [f"{what} {ours} (this model: {its})" for what, (ours, its) in pairs.items() if ours != its]
        if wrong:
            raise ConfigError(f"{source} was measured for another {'; '.join(wrong)}: profile this model here "
                              "(`cacheflow profile` with its --model and --dtype), or give its own profile")

    def cost_model(self, link_bytes_per_s: float | None) -> CostModel:
        return self.costs.with_link(link_bytes_per_s)

    def l_delta_for(self, link_bytes_per_s: float | None) -> int:
        """L_delta of the profiled link rate nearest `link_bytes_per_s` (log scale)."""
        if not self.crossovers:
            raise ConfigError("the profile holds no crossover measurement")
        if link_bytes_per_s is None or link_bytes_per_s <= 0 or math.isinf(link_bytes_per_s):
            return max(self.crossovers, key=lambda c: c.link_bytes_per_s).l_delta
        nearest = min(self.crossovers,
                      key=lambda c: abs(math.log(c.link_bytes_per_s) - math.log(link_bytes_per_s)))
        return nearest.l_delta

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["format"] = PROFILE_FORMAT
        return body

    def save(self, path: str | Path) -> None:
        """Write atomically (temp file, fsync, rename); `~` is expanded."""
        write_atomically(Path(path).expanduser(), json.dumps(self.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | Path, *, model: Transformer | None = None) -> Profile:
        """Read a profile file; `~` is expanded. With `model`, refuse a profile measured for another model,
        dtype or device."""
        try:
            body = json.loads(Path(path).expanduser().read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read profile {path}: {exc}") from exc
        profile = cls.from_json(body, source=str(path))
        if model is not None:
            profile.check_fits(model, source=f"profile {path}")
        return profile

    @classmethod
    def from_json(cls, body: dict[str, Any], *, source: str = "profile") -> Profile:
        if body.get("format") != PROFILE_FORMAT:
            raise ConfigError(f"{source}: unsupported profile format {body.get('format')!r}; "
                              "re-run `cacheflow profile`")
        try:
            costs = body["costs"]
            profile = cls(
                model=body["model"],
                model_name=body["model_name"],
                dtype=body["dtype"],
                device=body["device"],
                chunk_size=int(body["chunk_size"]),
                threads=int(body["threads"]),
                costs=CostModel(
                    chunk_compute=LinearCost(**costs["chunk_compute"]),
                    layer_compute=LinearCost(**costs["layer_compute"]),
                    load=LoadCost(**costs["load"]),
                ),
                crossovers=tuple(
                    Crossover(link_bytes_per_s=float(c["link_bytes_per_s"]), l_delta=int(c["l_delta"]),
                              table=tuple(c.get("table", ())))
                    for c in body["crossovers"]
                ),
                machine=dict(body.get("machine", {})),
                checks=tuple(MonotoneCheck(**c) for c in body.get("checks", ())),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: malformed profile ({exc!r}); re-run `cacheflow profile`") from exc
        _check_costs(profile.costs, source)
        return profile


def _check_costs(costs: CostModel, source: str) -> None:
    """Costs that fall as length grows (a negative or non-finite coefficient) would mislead every plan."""
    for name, cost in (("chunk_compute", costs.chunk_compute), ("layer_compute", costs.layer_compute)):
        if not cost.non_decreasing():
            raise ConfigError(f"{source}: its {name} cost {cost} falls as length grows (a coefficient is negative "
                              "or not finite); re-run `cacheflow profile`")
    if not (math.isfinite(costs.load.latency_s) and costs.load.latency_s >= 0 and costs.load.bytes_per_s > 0):
        raise ConfigError(f"{source}: its load cost {costs.load} is not a positive rate and latency; "
                          "re-run `cacheflow profile`")
