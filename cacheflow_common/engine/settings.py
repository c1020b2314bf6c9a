"""What one engine needs to know about the stage it runs: its place in the pipeline, its units and budgets,
its storage channels and the cost model its CacheFlow policies plan with.

A stage worker builds these from its `WorkerConfig` and profile; the library's `restore()` and the vLLM
connector from their own arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from cacheflow_common.errors import ConfigError
from cacheflow_common.restore.costs import CostModel
from cacheflow_common.sched.policies import POLICIES


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    layers: range  # the stage's layers [a_s, b_s)
    stage: int = 0  # its pipeline stage (0: fed by the token embeddings)
    pipeline: bool = False  # one stage of several (a stage s > 0, or one before the last)
    policy: str = "cacheflow"  # the default restore policy
    chunk_size: int = 256  # tokens per stored chunk: the unit either side may take
    prefill_tokens: int = 2048  # compute-only recomputes in units this long (its fastest prefill)
    step_tokens: int = 2048  # the compute loop's token budget per step (one restore unit always fits)
    beside_forward_tokens: int = 0  # restore tokens a step may carry beside forward work
    channels: tuple[str, ...] = ("store",)  # one loader per channel: the storage pods' ids, by default one
    costs: CostModel | None = None  # the profile's, behind the link in use; None: no profile
    l_delta: int = 0  # the prefix length from which token-wise beats layer-wise (the profile's)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if min(self.chunk_size, self.prefill_tokens, self.step_tokens) <= 0 or self.beside_forward_tokens < 0:
            raise ConfigError("chunk size, prefill and step budgets must be positive")
        if not self.channels or not len(self.layers):
            raise ConfigError("an engine needs at least one storage channel and one layer")
