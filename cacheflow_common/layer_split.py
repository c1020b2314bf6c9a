"""How a model's layers are split into pipeline stages (torch-free: the scheduler and simulator use it too)."""

from __future__ import annotations

from itertools import pairwise

from cacheflow_common.errors import ConfigError

__all__ = ["balanced_split", "parse_split"]


def balanced_split(n_layers: int, n_stages: int, *, layer_s: float = 1.0, first_extra_s: float = 0.0,
                   last_extra_s: float = 0.0) -> list[range]:
    """Contiguous layer ranges for `n_stages` stages minimising the slowest stage's cost.

    Every layer costs `layer_s`; stage 0 also pays `first_extra_s` (embedding, reading boundary-free
    input) and the last stage `last_extra_s` (final norm and LM head), so a split by measured cost can
    give the ends fewer layers than a split by count. Exact, by dynamic programming over split points.
    """
    if not 1 <= n_stages <= n_layers:
        raise ConfigError(f"cannot split {n_layers} layers into {n_stages} stages (each needs at least one)")

    def cost(start: int, stop: int) -> float:
        extra = (first_extra_s if start == 0 else 0.0) + (last_extra_s if stop == n_layers else 0.0)
        return layer_s * (stop - start) + extra

    # best[s][j]: (slowest stage cost, split points) covering layers [0, j) with s stages
    best: list[dict[int, tuple[float, tuple[int, ...]]]] = [{0: (0.0, ())}]
    for s in range(1, n_stages + 1):
        row: dict[int, tuple[float, tuple[int, ...]]] = {}
        for j in range(s, n_layers - (n_stages - s) + 1):
            row[j] = min((max(best[s - 1][i][0], cost(i, j)), (*best[s - 1][i][1], j))
                         for i in best[s - 1] if i < j)
        best.append(row)
    bounds = (0, *best[n_stages][n_layers][1])
    return [range(a, b) for a, b in pairwise(bounds)]


def parse_split(text: str, n_layers: int) -> list[range]:
    """"0:12,12:24" -> [range(0, 12), range(12, 24)]; must tile [0, n_layers) in order."""
    try:
        ranges = [range(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
    except ValueError as exc:
        raise ConfigError(f"layer split {text!r} is not like '0:12,12:24'") from exc
    stops = [0] + [r.stop for r in ranges]
    if any(r.start != prev or len(r) < 1 for r, prev in zip(ranges, stops, strict=False)) or stops[-1] != n_layers:
        raise ConfigError(f"layer split {text!r} must tile layers [0, {n_layers}) in order, no stage empty")
    return ranges
