"""Restore policies, registered once by name: the batch scheduler, the engine (`cacheflow_common.engine`), the
simulator and the benchmarks all take them from `POLICIES`.

A policy says what each side of the two pointers may do, how a request's prefix is cut into units
(token chunks or layers), how the meeting point is found, and which request a free I/O channel serves:

| policy               | mode          | meeting point          | channels serve first                           |
|----------------------|---------------|------------------------|------------------------------------------------|
| `compute-only`       | token         | everything computed    | nobody (vLLM on a miss)                        |
| `load-only`          | token         | everything loaded      | the oldest request (LMCache)                   |
| `cake`               | token         | where they meet        | the oldest request (per-request Cake)          |
| `cacheflow`          | N >= L_delta  | planned, batch-aware   | the least remaining recomputation (SRPT)       |
| `cacheflow-alg1`     | N >= L_delta  | planned, batch-aware   | the largest remaining recomputation (Alg. 1)   |
| `cacheflow-srpt`     | N >= L_delta  | planned, batch-aware   | the least remaining recomputation (as above)   |
| `cacheflow-progress` | N >= L_delta  | planned, batch-aware   | the largest share of its own work done         |
| `cacheflow-saving`   | N >= L_delta  | planned, batch-aware   | the unit saving most compute per link-second   |
| `cacheflow-token`    | token         | planned, batch-aware   | as `cacheflow`                                 |
| `cacheflow-layer`    | layer         | planned, batch-aware   | as `cacheflow`                                 |

"Remaining recomputation" (Algorithm 1 of the paper) is the predicted compute time of the request's
units that nobody has restored or claimed yet, over all its stages; it is re-evaluated at every
decision, so a request that has been served falls behind one that has not. Which ranking is
`cacheflow`'s default is measured, not assumed: `bench/results/sched_ranking.md` (simulator) and
`bench/results/batch.md` (the real engine) compare them. The least remaining recomputation first
measured best on both (9 of 9 simulated cells better than first come, up to 0.69x its mean TTFT; the
lowest mean restore time of the rankings on the local cluster), and Algorithm 1's the worst on both:
serving the longest restore first keeps every short one waiting behind it.
`saving` decides the other question, where a second of link saves the most compute: a free channel
takes, across the whole batch, the I/O-pointer unit (each request's and stage's highest pending unit on
that channel) whose predicted compute seconds per predicted load second are largest; late chunks of
long prefixes (attention over a long context) come first, the cheap early chunks are left to compute.
Measured (`cacheflow bench sweep --sim-only`, bench/results/sweep_sim.md: 6 trace windows x 3 load
levels), `saving` loses to least-remaining and to Cake on the mean at every level (median 1.07-1.16x
Cake's) and only matches them on the slowest request: in the engine's batched steps a request's chain
pays a whole step per computed unit whatever the chunk, so a load saves about the same step for any
compute-bound request, and what the mean rewards is finishing requests (leaving the batch, freeing a
slot), which least-remaining does and a batch-wide compute-per-link-second rule does not. It stays
selectable; `cacheflow` keeps least-remaining.
When policies are mixed on one stage, requests of planned (CacheFlow) policies are served first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cacheflow_common.errors import ConfigError

MODES = ("adaptive", "token", "layer")
PLANNERS = ("compute", "load", "greedy", "planned")  # fixed split at n, fixed split at 0, Cake's, CacheFlow's
RANKINGS = ("arrival", "most-remaining", "least-remaining", "most-done", "response-ratio", "saving")
SAVING_TIES = 1e-9  # savings per link-second this close are equal: the least remaining recomputation goes first


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


@dataclass(frozen=True, kw_only=True)
class Policy:
    name: str
    mode: str  # "adaptive" (token-wise iff N >= L_delta), "token" or "layer"
    planner: str  # how the meeting point is found (PLANNERS)
    ranking: str  # which request a free channel serves (RANKINGS)
    summary: str  # one line for help texts and reports

    def __post_init__(self) -> None:
        if self.mode not in MODES or self.planner not in PLANNERS or self.ranking not in RANKINGS:
            raise ConfigError(f"policy {self.name!r}: bad mode, planner or ranking")

    @property
    def loads(self) -> bool:
        """Channels serve this policy's requests at all."""
        return self.planner != "compute"

    @property
    def computes_pending(self) -> bool:
        """Compute may take a unit storage could still deliver (load-only computes only misses)."""
        return self.planner != "load"

    @property
    def adaptive_mode(self) -> bool:
        return self.mode == "adaptive"

    @property
    def ranks_units(self) -> bool:
        """A free channel picks a unit across the batch (by `unit_rank`), not a request (by `load_rank`)."""
        return self.ranking == "saving"

    @property
    def plans_meeting(self) -> bool:
        """The meeting point is planned from predicted costs (needs a profile); else found greedily."""
        return self.planner == "planned"

    def load_rank(self, request: LoadCandidate, now: float) -> tuple[float, ...]:
        """Channels serve the request with the highest rank first (`now`: the caller's clock, as arrival_s)."""
        ties = (-request.arrival_s, -request.order)
        if self.ranking == "response-ratio":  # (waited + remaining) / remaining: short first, none starves
            waited = max(0.0, now - request.arrival_s)
            return (1, (waited + request.remaining_s) / max(request.remaining_s, 1e-9), *ties)
        if self.ranking == "most-remaining":
            return (1, request.remaining_s, *ties)
        if self.ranking == "least-remaining":
            return (1, -request.remaining_s, *ties)
        if self.ranking == "most-done":
            done = 1 - request.remaining_s / request.total_s if request.total_s > 0 else 1.0
            return (1, done, *ties)
        return (0, *ties)

    def unit_rank(self, request: LoadCandidate, compute_s: float, load_s: float, now: float) -> tuple[float, ...]:
        """The rank of loading one unit of `request` that computing would take `compute_s` and loading
        `load_s` link-seconds: by the recomputation it saves per link-second (`saving`), ties to the least
        remaining recomputation; other rankings rank the request (`load_rank`)."""
        if not self.ranks_units:
            return self.load_rank(request, now)
        saving = round(compute_s / max(load_s, 1e-12) / SAVING_TIES) * SAVING_TIES
        return (1, saving, -request.remaining_s, -request.arrival_s, -request.order)


_ALL = (
    Policy(name="compute-only", mode="token", planner="compute", ranking="arrival",
           summary="recompute the whole prefix (vLLM on a cache miss)"),
    Policy(name="load-only", mode="token", planner="load", ranking="arrival",
           summary="load the whole prefix; compute only misses (LMCache)"),
    Policy(name="cake", mode="token", planner="greedy", ranking="arrival",
           summary="Cake: token-wise two pointers per request, channels in arrival order"),
    Policy(name="cacheflow", mode="adaptive", planner="planned", ranking="least-remaining",
           summary="CacheFlow: adaptive mode, batch-aware meeting points, channels to the least recomputation left"),
    Policy(name="cacheflow-alg1", mode="adaptive", planner="planned", ranking="most-remaining",
           summary="CacheFlow with Algorithm 1's ranking: channels to the largest remaining recomputation"),
    Policy(name="cacheflow-srpt", mode="adaptive", planner="planned", ranking="least-remaining",
           summary="CacheFlow with channels to the least remaining recomputation"),
    Policy(name="cacheflow-progress", mode="adaptive", planner="planned", ranking="most-done",
           summary="CacheFlow with channels to the request with the largest share of its own work done"),
    Policy(name="cacheflow-hrrn", mode="adaptive", planner="planned", ranking="response-ratio",
           summary="CacheFlow with channels to the highest response ratio: (waited + remaining) / remaining"),
    Policy(name="cacheflow-saving", mode="adaptive", planner="planned", ranking="saving",
           summary="CacheFlow with channels to the unit saving the most recomputation per link-second, batch-wide"),
    Policy(name="cacheflow-token", mode="token", planner="planned", ranking="least-remaining",
           summary="CacheFlow, token-wise only"),
    Policy(name="cacheflow-layer", mode="layer", planner="planned", ranking="least-remaining",
           summary="CacheFlow, layer-wise only"),
)
POLICIES: dict[str, Policy] = {p.name: p for p in _ALL}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None


def token_unit(policy: Policy, chunk_size: int, prefill_tokens: int) -> int:
    """Tokens per unit of a token-wise restore: the storage chunk (either side may take any unit), or for
    compute-only, which never loads, the engine's prefill size in whole chunks (its fastest recompute)."""
    if policy.planner != "compute":
        return chunk_size
    return max(chunk_size, prefill_tokens // chunk_size * chunk_size)


def choose_mode(policy: Policy, n_tokens: int, l_delta: int) -> str:
    """Token-wise or layer-wise: fixed by the policy, or token-wise iff the prefix has >= L_delta tokens."""
    if policy.mode != "adaptive":
        return policy.mode
    return "token" if n_tokens >= l_delta else "layer"
