"""Restore policies, registered once by name: the batch scheduler, the engine (`cacheflow_common.engine`), the
simulator and the benchmarks all take them from `POLICIES`.

A policy says what each side of the two pointers may do, how a request's prefix is cut into units
(token chunks or layers), how the meeting point is found, which requests a compute step advances, and
which request a free I/O channel serves:

| policy               | mode         | meeting point | a step computes for | channels serve first          |
|----------------------|--------------|---------------|---------------------|-------------------------------|
| `compute-only`       | token        | all computed  | every request       | nobody (vLLM on a miss)       |
| `load-only`          | token        | all loaded    | every request       | the oldest (LMCache)          |
| `cake`               | token        | where they meet | every request     | the oldest (per-request Cake) |
| `cacheflow`          | N >= L_delta | planned       | shortest and oldest | the oldest                    |
| `cacheflow-srpt`     | N >= L_delta | planned       | every request       | least remaining recomputation |
| `cacheflow-alg1`     | N >= L_delta | planned       | every request       | most remaining (Algorithm 1)  |
| `cacheflow-progress` | N >= L_delta | planned       | every request       | largest share of its work done |
| `cacheflow-hrrn`     | N >= L_delta | planned       | every request       | highest response ratio        |
| `cacheflow-saving`   | N >= L_delta | planned       | every request       | most compute saved per link-s |
| `cacheflow-token`    | token        | planned       | as `cacheflow`      | as `cacheflow`                |
| `cacheflow-layer`    | layer        | planned       | as `cacheflow`      | as `cacheflow`                |

"Planned" meeting points are batch-aware (`meeting.py`).

`cacheflow` makes the batch's two decisions by two rules. The mean rewards finishing short requests
early, so each compute step advances the request with the least remaining recomputation (every one
that ties: equal prefixes go together); the slowest request must not pay for that, so the same step
also advances the oldest request, and the channels serve the oldest requests first, each from its top
unit down (the late chunks, the costliest to recompute). I/O thus flows to the requests that have
waited longest, short requests finish by compute before any load for them would land, and each
request's meeting point follows from both (`meeting.py`). The rules it replaced (every request in every step,
the channels to the least remaining recomputation: `cacheflow-srpt`) and the other rankings stay
selectable and are measured beside it (`cacheflow bench sweep`, `cacheflow bench batch`).

Why these rules, measured. "Remaining recomputation" (Algorithm 1 of the paper) is the predicted
compute time of the request's units that nobody has restored or claimed yet, over all its stages,
re-evaluated at every decision. Ranking the channels by it, least first (`cacheflow-srpt`, the default
until the trace sweep), beat first-come channels on the mean (`bench/results/sched_ranking.md`) but
starved the long requests of I/O: their slowest request reached 1.28x Cake's in the sweep. Algorithm
1's most-remaining-first is worst on the mean: the longest restore keeps every short one waiting.
`saving` (a free channel takes, across the batch, the I/O-pointer unit with the most predicted compute
seconds per load second: the late chunks of long prefixes) lost on the mean at every load level (median
1.07-1.16x Cake's), because a load saves about one step of its request's chain whatever the chunk, and
the mean rewards finishing requests. What finishes short requests early is the compute loop: a request
computes one unit per step, and a step over 8 requests costs each of them the whole batch's time, so
advancing only the shortest (and the oldest) lets short requests leave in a few cheap steps while the
channels restore the old ones (`bench/results/sweep_sim.md`).
When policies are mixed on one stage, every-request policies compute in every step, and the channels
rank requests of planned (CacheFlow) policies that rank by size before first-come ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cacheflow_common.errors import ConfigError

MODES = ("adaptive", "token", "layer")
PLANNERS = ("compute", "load", "greedy", "planned")  # fixed split at n, fixed split at 0, Cake's, CacheFlow's
COMPUTE_RULES = ("every-request", "shortest-and-oldest")  # which requests a compute step advances
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
    compute: str = "every-request"  # which requests a compute step advances (COMPUTE_RULES)

    def __post_init__(self) -> None:
        if (self.mode not in MODES or self.planner not in PLANNERS or self.ranking not in RANKINGS
                or self.compute not in COMPUTE_RULES):
            raise ConfigError(f"policy {self.name!r}: bad mode, planner, ranking or compute rule")

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
    def advances_few(self) -> bool:
        """A compute step advances only this policy's shortest and oldest requests, not all of them."""
        return self.compute == "shortest-and-oldest"

    @property
    def ranks_units(self) -> bool:
        """A free channel picks a unit across the batch (by `unit_rank`), not a request (by `load_rank`)."""
        return self.ranking == "saving"

    @property
    def rank_moves_with_time(self) -> bool:
        """`load_rank` changes as the clock runs, not only when the request's units change state."""
        return self.ranking == "response-ratio"

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
    Policy(name="cacheflow", mode="adaptive", planner="planned", ranking="arrival", compute="shortest-and-oldest",
           summary="CacheFlow: adaptive mode, batch-aware meeting points, compute to the shortest and oldest "
                   "requests, channels to the oldest"),
    Policy(name="cacheflow-alg1", mode="adaptive", planner="planned", ranking="most-remaining",
           summary="CacheFlow with Algorithm 1's ranking: channels to the largest remaining recomputation"),
    Policy(name="cacheflow-srpt", mode="adaptive", planner="planned", ranking="least-remaining",
           summary="CacheFlow with every request in every step, channels to the least remaining recomputation"),
    Policy(name="cacheflow-progress", mode="adaptive", planner="planned", ranking="most-done",
           summary="CacheFlow with channels to the request with the largest share of its own work done"),
    Policy(name="cacheflow-hrrn", mode="adaptive", planner="planned", ranking="response-ratio",
           summary="CacheFlow with channels to the highest response ratio: (waited + remaining) / remaining"),
    Policy(name="cacheflow-saving", mode="adaptive", planner="planned", ranking="saving",
           summary="CacheFlow with channels to the unit saving the most recomputation per link-second, batch-wide"),
    Policy(name="cacheflow-token", mode="token", planner="planned", ranking="arrival", compute="shortest-and-oldest",
           summary="CacheFlow, token-wise only"),
    Policy(name="cacheflow-layer", mode="layer", planner="planned", ranking="arrival", compute="shortest-and-oldest",
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


def choose_mode(policy: Policy, n_tokens: int, l_delta: int, *, pipeline: bool, delivers: bool = False) -> str:
    """Token-wise or layer-wise, for the engine and the simulator alike: fixed by the policy, or token-wise
    iff the prefix has >= L_delta tokens.

    `pipeline`: the stage is one of several. An adaptive policy then goes token-wise on every stage: a
    layer-wise restore on stage s > 0 reads the whole prefix's boundary activations before its first
    layer, a cost the single-stage L_delta does not see. `delivers`: the restore hands its chunks to the
    next stage as it computes them, so it goes token-wise whatever the policy.
    """
    mode = policy.mode if not policy.adaptive_mode else ("token" if n_tokens >= l_delta else "layer")
    if mode == "layer" and (delivers or (pipeline and policy.adaptive_mode)):
        return "token"
    return mode


NO_PROFILE = "no profile: run `cacheflow profile` for CacheFlow's planning"


def usable_policy(policy: Policy, *, profiled: bool) -> tuple[Policy, str]:
    """The policy a restore runs with, and why it is not `policy` ("" when it is): the planned (CacheFlow)
    policies need a profile's costs; without one, Cake's greedy meeting point stands in. The stage
    workers, the vLLM connector and the library's `restore()` all take this rule."""
    if policy.plans_meeting and not profiled:
        return POLICIES["cake"], NO_PROFILE
    return policy, ""
