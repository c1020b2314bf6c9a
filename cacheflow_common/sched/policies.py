"""Restore policies behind one interface: who computes what, and which request each I/O channel serves.

Every policy advances the compute pointers of every active request (batched, oldest first); they differ
in what the I/O channels do:

| policy               | channels serve                                 | compute takes           | modes           |
|----------------------|------------------------------------------------|-------------------------|-----------------|
| `cacheflow`          | the largest remaining recomputation cost first | any unit at its pointer | layer < L_delta |
| `cake`               | the oldest request first (per-request Cake)    | any unit at its pointer | token           |
| `compute-only`       | nothing                                        | everything              | token           |
| `load-only`          | the oldest request first                       | only what cannot load   | token           |
| `cacheflow-srpt`     | the least remaining recomputation cost first   | any unit at its pointer | layer < L_delta |
| `cacheflow-progress` | the largest share of its own work done first   | any unit at its pointer | layer < L_delta |

The last two are other channel rankings for the simulator's study of Algorithm 1's
(`python -m cacheflow_bench.sched_ranking`); the workers implement `cacheflow`'s and arrival order.

"Remaining recomputation cost" (Algorithm 1 of the paper) is the predicted compute time of the
request's units that nobody has restored or claimed yet, over all stages; it is re-evaluated at every
decision, so a request that has been served falls behind one that has not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cacheflow_common.errors import ConfigError


class LoadCandidate(Protocol):
    """What a policy sees of a request when ranking it for a channel."""

    @property
    def remaining_s(self) -> float: ...

    @property
    def arrival_s(self) -> float: ...

    @property
    def order(self) -> int: ...  # admission order (ties in arrival time)

    @property
    def total_s(self) -> float: ...  # predicted compute seconds of all its units, over all stages


class Policy(Protocol):
    name: str
    loads: bool  # channels serve loads at all
    computes_pending: bool  # compute may take a unit storage could still deliver
    adaptive_mode: bool  # layer-wise below L_delta (else always token-wise)

    def load_rank(self, request: LoadCandidate) -> tuple[float, ...]:
        """Channels serve the request with the highest rank first."""
        ...


class CacheFlowPolicy:
    """Algorithm 1: I/O goes where it saves the most recomputation (longest remaining work first)."""

    name = "cacheflow"
    loads = True
    computes_pending = True
    adaptive_mode = True

    def load_rank(self, request: LoadCandidate) -> tuple[float, ...]:
        return (request.remaining_s, -request.arrival_s, -request.order)


class ShortestRemainingPolicy(CacheFlowPolicy):
    """CacheFlow's two pointers, but channels serve the request with the least recomputation left."""

    name = "cacheflow-srpt"

    def load_rank(self, request: LoadCandidate) -> tuple[float, ...]:
        return (-request.remaining_s, -request.arrival_s, -request.order)


class MostProgressPolicy(CacheFlowPolicy):
    """CacheFlow's two pointers, but channels serve the request nearest its end, as a share of its own work."""

    name = "cacheflow-progress"

    def load_rank(self, request: LoadCandidate) -> tuple[float, ...]:
        done = 1 - request.remaining_s / request.total_s if request.total_s > 0 else 1.0
        return (done, -request.arrival_s, -request.order)


class _FirstComeFirstServed:
    """Channels serve requests in arrival order."""

    adaptive_mode = False

    def load_rank(self, request: LoadCandidate) -> tuple[float, ...]:
        return (-request.arrival_s, -request.order)


class CakePolicy(_FirstComeFirstServed):
    """Cake, request by request: two pointers per request, I/O to the oldest request."""

    name = "cake"
    loads = True
    computes_pending = True


class ComputeOnlyPolicy(_FirstComeFirstServed):
    """vLLM on a cache miss: recompute everything, read nothing."""

    name = "compute-only"
    loads = False
    computes_pending = True


class LoadOnlyPolicy(_FirstComeFirstServed):
    """LMCache: load everything; compute only units storage cannot deliver (misses, not stored, lost)."""

    name = "load-only"
    loads = True
    computes_pending = False


POLICIES: dict[str, Callable[[], Policy]] = {
    p.name: p for p in (CacheFlowPolicy, CakePolicy, ComputeOnlyPolicy, LoadOnlyPolicy, ShortestRemainingPolicy,
                        MostProgressPolicy)
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ConfigError(f"unknown scheduling policy {name!r}; choose one of {', '.join(POLICIES)}") from None
