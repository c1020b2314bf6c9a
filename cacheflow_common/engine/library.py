"""The library's entry point: one request's restore on one stage, by any policy — a batch of one in a
`Engine` of its own (its threads live as long as the call).

Channels: a store over several pods (`ClusterStore`) gets one loader per pod, as a worker does; any other
store one loader, or for load-only `LOAD_ONLY_READS_IN_FLIGHT` (one read lands while the next crosses the
link: the baseline at its strongest). Misses (absent or corrupt chunks) are recomputed by every policy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cacheflow_common.engine.engine import Engine
from cacheflow_common.engine.settings import EngineSettings
from cacheflow_common.engine.stage_restore import StageInput
from cacheflow_common.errors import ConfigError
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.costs import CostModel
from cacheflow_common.restore.executor import LOAD_ONLY_READS_IN_FLIGHT
from cacheflow_common.restore.job import ChunkComputed, RestoreJob, RestoreResult
from cacheflow_common.sched.policies import Policy, make_policy
from cacheflow_common.store.base import ChunkStore

REQUEST_ID = "restore"
RowsOf = Callable[[int, int], torch.Tensor]  # the stage's input rows for tokens [start, end): [T, hidden]


def restore(job: RestoreJob, *, model: Transformer, store: ChunkStore, policy: str, costs: CostModel | None = None,
            l_delta: int = 0, kv: KVBuffer | None = None, stage_input: StageInput | RowsOf | None = None,
            on_computed: ChunkComputed | None = None, prefill_tokens: int = 2048) -> RestoreResult:
    """Restore `job` with `policy`; returns what was done (the KV in `result.kv`).

    `kv`: the buffer to fill (allocated if None); `costs`: the profile's cost model behind the link in use
    (the CacheFlow policies need it); `stage_input`: the compute side's input (default: the token
    embeddings), a `StageInput` or any function of (start, end) that returns its rows; `on_computed` hears
    of every chunk computed (the restore then goes token-wise, in the stored chunks); compute-only
    recomputes in units of `prefill_tokens`.
    """
    chosen = make_policy(policy)
    if chosen.plans_meeting and costs is None:
        raise ConfigError(f"policy {policy!r} needs a cost model: run `cacheflow profile` and pass its costs")
    settings = EngineSettings(layers=job.layers, policy=policy, chunk_size=job.chunk_size, costs=costs,
                              l_delta=l_delta, prefill_tokens=prefill_tokens, channels=_channels(store, chosen))
    with Engine.for_connector(settings, model) as engine:  # this thread computes
        kvs = {REQUEST_ID: kv} if kv is not None else None
        result = engine.restore_batch({REQUEST_ID: job}, store, policy, kvs=kvs, inputs=_as_stage_input(stage_input),
                                      on_computed=on_computed)[REQUEST_ID]
    if isinstance(result, Exception):
        raise result
    return result


def _channels(store: ChunkStore, policy: Policy) -> tuple[str, ...]:
    pods = getattr(store, "pods", None)
    if isinstance(pods, dict) and pods:
        return tuple(pods)
    readers = LOAD_ONLY_READS_IN_FLIGHT if policy.planner == "load" else 1
    return tuple(f"reader-{i}" for i in range(readers))


class _InMemory:
    """A stage input the caller already holds in full: always ready."""

    def __init__(self, rows_of: RowsOf) -> None:
        self.rows_of = rows_of

    def __call__(self, start: int, end: int) -> torch.Tensor:
        return self.rows_of(start, end)  # [T, hidden]

    def ready(self, start: int, end: int) -> bool:
        return True


def _as_stage_input(given: StageInput | RowsOf | None) -> StageInput | None:
    if given is None or hasattr(given, "ready"):
        return given  # type: ignore[return-value]
    return _InMemory(given)
