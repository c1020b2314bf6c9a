"""Cost model of a restore, and the optimal two-pointer bound.

Compute costs are per layer, so one profile serves any stage's layer range:

* a token chunk of `T` tokens starting at position `p` costs, per layer,
  `fixed + per_token * T + per_token_ctx * T * (p + T / 2)` — the last term is attention over the
  context, which is why late chunks cost more (quadratic total);
* one layer over all `N` prefix tokens (layer-wise compute) costs
  `fixed + per_token * N + per_token_ctx * N * N / 2`.

Loading costs `latency + bytes / rate` per read, where `rate` is the slower of the store's raw
throughput and the (emulated) link.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LinearCost:
    """`fixed + per_token * T + per_token_ctx * T * mean_context` seconds, for one layer."""

    fixed_s: float
    per_token_s: float
    per_token_ctx_s: float

    def of(self, n_tokens: int, mean_context: float) -> float:
        return self.fixed_s + self.per_token_s * n_tokens + self.per_token_ctx_s * n_tokens * mean_context

    def non_decreasing(self) -> bool:
        """Every coefficient finite and >= 0: the cost never falls as tokens or context grow."""
        return all(math.isfinite(v) and v >= 0 for v in (self.fixed_s, self.per_token_s, self.per_token_ctx_s))


@dataclass(frozen=True, kw_only=True)
class LoadCost:
    """Reading `n` bytes in one request costs `latency_s + n / bytes_per_s`."""

    bytes_per_s: float
    latency_s: float

    def of(self, n_bytes: int, n_reads: int = 1) -> float:
        return self.latency_s * n_reads + n_bytes / self.bytes_per_s


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Predicted seconds for each restore unit of one request on one stage."""

    chunk_compute: LinearCost  # per layer, for one token chunk
    layer_compute: LinearCost  # per layer, over the whole prefix at once
    load: LoadCost

    def with_link(self, link_bytes_per_s: float | None) -> CostModel:
        """The same model behind a link of `link_bytes_per_s` (None or <= 0: no link limit)."""
        if link_bytes_per_s is None or link_bytes_per_s <= 0:
            return self
        rate = min(self.load.bytes_per_s, link_bytes_per_s)
        return CostModel(
            chunk_compute=self.chunk_compute,
            layer_compute=self.layer_compute,
            load=LoadCost(bytes_per_s=rate, latency_s=self.load.latency_s),
        )

    def scaled(self, *, compute: float = 1.0, load: float = 1.0) -> CostModel:
        """Every compute cost times `compute`, every load time times `load` (a calibration against runs)."""
        return CostModel(
            chunk_compute=_times(self.chunk_compute, compute),
            layer_compute=_times(self.layer_compute, compute),
            load=LoadCost(bytes_per_s=self.load.bytes_per_s / load, latency_s=self.load.latency_s * load),
        )

    def chunk_compute_s(self, start: int, end: int, n_layers: int) -> float:
        n = end - start
        return n_layers * self.chunk_compute.of(n, start + n / 2)

    def layer_compute_s(self, n_tokens: int) -> float:
        return self.layer_compute.of(n_tokens, n_tokens / 2)

    def chunk_load_s(self, n_bytes: int) -> float:
        return self.load.of(n_bytes)

    def layer_load_s(self, n_bytes: int, n_chunks: int) -> float:
        return self.load.of(n_bytes, n_reads=n_chunks)


def _times(cost: LinearCost, factor: float) -> LinearCost:
    return LinearCost(fixed_s=cost.fixed_s * factor, per_token_s=cost.per_token_s * factor,
                      per_token_ctx_s=cost.per_token_ctx_s * factor)


def best_split(compute_s: Sequence[float], load_s: Sequence[float]) -> tuple[int, float]:
    """The two-pointer optimum: units `< k` computed, `>= k` loaded; returns `(k, T*)`.

    `T* = min over k of max(sum(compute_s[:k]), sum(load_s[k:]))`. Both sides start idle.
    """
    return best_split_from(compute_s, load_s, compute_ready_s=0.0, load_ready_s=0.0)


def best_split_from(
    compute_s: Sequence[float],
    load_s: Sequence[float],
    *,
    compute_ready_s: float,
    load_ready_s: float,
) -> tuple[int, float]:
    """Like `best_split`, when compute is busy for `compute_ready_s` and I/O for `load_ready_s` first."""
    n = len(compute_s)
    if len(load_s) != n:
        raise ValueError(f"cost lists differ in length: {n} vs {len(load_s)}")
    suffix_load = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix_load[i] = suffix_load[i + 1] + load_s[i]
    prefix_compute = [0.0] * (n + 1)
    for i in range(n):
        prefix_compute[i + 1] = prefix_compute[i] + compute_s[i]
    return earliest_split(n, lambda k: compute_ready_s + prefix_compute[k], lambda k: load_ready_s + suffix_load[k])


# -- the split that ends a restore first: one rule for the bound (above) and the batch meeting point -----------
# Units `< k` computed, `>= k` loaded: the restore ends at max(compute_end(k), load_end(k)). Compute's end never
# falls as k grows and the loads' end never rises (costs are never negative), so the end falls while the loads
# finish last and rises from the first k where compute does. Exact (integer) ends are compared exactly.
End = Callable[[int], float]


def earliest_split(n: int, compute_end: End, load_end: End) -> tuple[int, float]:
    """The k in [0, n] that ends the restore first (the lowest where several end at once), and that end;
    bisections, not a scan."""
    cross = _first(0, n, lambda k: compute_end(k) >= load_end(k))  # from here on, compute ends last
    if cross == 0:
        return 0, compute_end(0)
    loads_last = load_end(cross - 1)  # the least end among k < cross, where the loads end last
    lowest = _first(0, cross - 1, lambda k: load_end(k) <= loads_last)
    if cross > n or loads_last <= (compute_last := compute_end(cross)):
        return lowest, loads_last
    return cross, compute_last


def earliest_split_computes(n: int, compute_end: End, load_end: End) -> bool:
    """`earliest_split(...)[0] > 0`, evaluating `load_end` twice only (the meeting point asks it at every
    compute decision): some k >= 1 ends strictly sooner than k = 0 exactly when the largest k whose compute
    ends before k = 0's end does, since the loads' end is least there."""
    at_zero = max(compute_end(0), load_end(0))
    k = _first(0, n, lambda k: compute_end(k) >= at_zero) - 1  # the largest k whose compute ends before
    return k > 0 and load_end(k) < at_zero


def _first(lo: int, hi: int, holds: Callable[[int], bool]) -> int:
    """The least k in [lo, hi] where `holds` (false, then true, as k grows) is true; hi + 1 if none."""
    while lo <= hi:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid - 1
        else:
            lo = mid + 1
    return lo
