"""The machine profile `cacheflow profile` writes: fitted costs and the measured L_delta crossover.

A profile is a small JSON file, loaded at start. `L_delta` (the prefix length from which token-wise
restore beats layer-wise) depends on the hardware and on the link, so the profile keeps one crossover
per profiled link rate; `l_delta_for(rate)` takes the one nearest in log scale.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from cacheflow_common.errors import ConfigError
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost

PROFILE_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class Crossover:
    """Measured restore times of both modes at one link rate, and the crossover length L_delta."""

    link_bytes_per_s: float
    l_delta: int
    table: tuple[dict[str, float], ...] = ()  # rows: n_tokens, token_s, layer_s


@dataclass(frozen=True, kw_only=True)
class Profile:
    model: str  # model fingerprint
    model_name: str
    dtype: str
    chunk_size: int
    threads: int
    costs: CostModel
    crossovers: tuple[Crossover, ...]
    machine: dict[str, Any] = field(default_factory=dict)

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
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".profile-")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile file; `~` is expanded."""
        try:
            body = json.loads(Path(path).expanduser().read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read profile {path}: {exc}") from exc
        return cls.from_json(body, source=str(path))

    @classmethod
    def from_json(cls, body: dict[str, Any], *, source: str = "profile") -> Profile:
        if body.get("format") != PROFILE_FORMAT:
            raise ConfigError(f"{source}: unsupported profile format {body.get('format')!r}; "
                              "re-run `cacheflow profile`")
        try:
            costs = body["costs"]
            return cls(
                model=body["model"],
                model_name=body["model_name"],
                dtype=body["dtype"],
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
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: malformed profile ({exc!r}); re-run `cacheflow profile`") from exc
