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
from collections.abc import Sequence
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
    best_k, best_t, prefix_compute = 0, float("inf"), 0.0
    for k in range(n + 1):
        t = max(compute_ready_s + prefix_compute, load_ready_s + suffix_load[k])
        if t < best_t:
            best_k, best_t = k, t
        if k < n:
            prefix_compute += compute_s[k]
    return best_k, best_t
