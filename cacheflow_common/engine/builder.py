"""Turning a restore request into the engine's `StageRestore`: the policy actually used (and why, when it
differs from the one asked for), the mode, the plan the scheduler ranks and times it by, the loader,
and where the compute side's inputs come from.

* Units: token chunks of `chunk_size` (what storage holds, so that either side can take any unit);
  compute-only restores recompute in the engine's prefill size (`prefill_tokens`) instead — its
  fastest recompute, the strongest form of the baseline. Layer mode: one unit per layer.
* Channels: a token unit loads from the pod that holds its chunk (the first of its placement); a
  layer unit reads every chunk, and goes to channel `layer % pods`.
* Holes: a layer-wise restore over a prefix with an absent chunk goes token-wise (checked before planning).
* Costs: the profile's, behind the link rate the worker was told (`link_gbps`); without a profile,
  the planned (CacheFlow) policies fall back to Cake's greedy meeting point, and the answer says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from cacheflow_common.engine.settings import EngineSettings
from cacheflow_common.engine.stage_restore import RestoreSpec, StageRestore
from cacheflow_common.errors import BadRequestError
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.boundary import BoundaryInput, BoundaryMissingError
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.restore.job import ChunkComputed, RestoreJob
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.restore.stage_input import EmbeddingInput, StageInput
from cacheflow_common.restore.upstream import UpstreamInput
from cacheflow_common.sched.plan import build_plan
from cacheflow_common.sched.policies import POLICIES, choose_mode, make_policy, token_unit, usable_policy
from cacheflow_common.store.base import ChunkStore

UPSTREAM_FED = ("pipelined", "sequential")  # restore inputs taken from the previous stage's output
# Without a profile the plan's numbers only order units (the greedy and fixed policies use no times).
UNPROFILED = CostModel(chunk_compute=LinearCost(fixed_s=0.0, per_token_s=1e-6, per_token_ctx_s=1e-9),
                       layer_compute=LinearCost(fixed_s=0.0, per_token_s=1e-6, per_token_ctx_s=1e-9),
                       load=LoadCost(bytes_per_s=1e9, latency_s=0.0))


class RestoreBuilder:
    def __init__(self, settings: EngineSettings, model: Transformer, *, on_input: Callable[[], None]) -> None:
        self.config = settings
        self.model = model
        self.on_input = on_input  # told when a background read of inputs lands (wakes the compute loop)
        self.profiled = settings.costs is not None
        self.costs = settings.costs or UNPROFILED
        self.l_delta = settings.l_delta

    def build(self, request_id: str, job: RestoreJob, store: ChunkStore, kv: KVBuffer, policy_name: str, *,
              input_mode: str, arrival_s: float, inputs: StageInput | None = None,
              on_computed: ChunkComputed | None = None, on_loaded: Callable[[int], None] | None = None
              ) -> StageRestore:
        """`arrival_s`: when the request arrived, on this process's perf_counter clock (the scheduler's).
        `inputs`: where the compute side's input comes from, if not from the stage's own (the embeddings on
        stage 0, else the stored boundary activations): an `UpstreamInput` fed by the previous stage, or any
        `StageInput` of the caller's. `on_computed` hears of every chunk computed (token-wise), `on_loaded` of
        every chunk loaded (token-wise, on the loading channel's thread, in the load's time)."""
        upstream = isinstance(inputs, UpstreamInput)
        if isinstance(inputs, UpstreamInput):
            inputs.on_wake(self.on_input)  # a delivery may make a unit computable: the loop re-checks
        spec = self.spec(request_id, job, policy_name, input_mode=input_mode, upstream=upstream,
                         delivers=on_computed is not None)
        loader = KVLoader(store=store, keys=job.keys, layers=job.layers, kv=kv, dtype=job.kv_dtype, quant=job.quant,
                          heads=job.heads)
        spec = replace(_token_wise_over_holes(spec, loader), profiled=self.profiled)
        unit_size = self._unit_size(spec, delivers=on_computed is not None)
        units = _units(spec.mode, len(job.token_ids), unit_size, len(job.layers))
        plan = build_plan(request_id=request_id, arrival_s=arrival_s, n_tokens=len(job.token_ids),
                          costs=self.costs, stage_layers=[len(job.layers)], chunk_size=unit_size, mode=spec.mode,
                          kv_bytes_per_token_layer=self.model.kv_bytes_per_token_per_layer,
                          place=self._placement(store, loader, spec.mode))
        inputs, closers = (inputs, ()) if inputs is not None else self._inputs(job, store)
        if isinstance(inputs, BoundaryInput) and units:
            inputs.ready(*units[0])  # its first read starts now, not when a compute step first looks at it
        return StageRestore(spec, plan=plan, kv=kv, loader=loader, inputs=inputs, unit_tokens=units,
                            on_computed=on_computed, on_loaded=on_loaded, closers=closers)

    def spec(self, request_id: str, job: RestoreJob, policy_name: str, *, input_mode: str, upstream: bool,
             delivers: bool) -> RestoreSpec:
        """The policy and mode this stage restores with, and why they differ from what was asked, if they do.

        A stage fed by the previous one computes only what was delivered: Cake's greedy pointers. Without
        a profile, the CacheFlow policies fall back to Cake (`usable_policy`); the mode is `choose_mode`'s,
        the simulator's rule too.
        """
        if policy_name not in POLICIES:
            raise BadRequestError(f"unknown policy {policy_name!r}; choose one of {', '.join(POLICIES)}")
        policy, fallback = usable_policy(make_policy(policy_name), profiled=self.profiled)
        if upstream:
            policy, fallback = make_policy("cake"), "fed by the previous stage: greedy pointers"
        mode = choose_mode(policy, len(job.token_ids), self.l_delta, pipeline=self.config.pipeline, delivers=delivers)
        return RestoreSpec(request_id=request_id, job=job, policy=policy, mode=mode, input_mode=input_mode,
                           fallback=fallback)

    def _unit_size(self, spec: RestoreSpec, *, delivers: bool) -> int:
        if delivers:  # the next stage takes our output chunk by chunk
            return self.config.chunk_size
        return token_unit(spec.policy, self.config.chunk_size, self.config.prefill_tokens)

    def _placement(self, store: ChunkStore, loader: KVLoader, mode: str) -> Callable[[int, int], int]:
        pods = list(self.config.channels)
        placement = getattr(store, "placement", None)

        def channel(_stage: int, unit: int) -> int:
            if mode == "layer" or placement is None:
                return unit % len(pods)
            primary = placement(loader.names(unit))[0]
            return pods.index(primary) if primary in pods else unit % len(pods)

        return channel

    def _inputs(self, job: RestoreJob, store: ChunkStore) -> tuple[StageInput, tuple[Callable[[], None], ...]]:
        """The stage's own inputs: stage 0's embeddings, else the boundary activations in storage."""
        if self.config.stage == 0:
            return EmbeddingInput(self.model, job.token_ids), ()
        boundary = BoundaryInput(job, store, device=self.model.device, on_read=self.on_input)
        if missing := boundary.missing():
            boundary.close()
            raise BoundaryMissingError(f"boundary activations missing for chunks "
                                       f"{missing[:8]}{'...' if len(missing) > 8 else ''}; restore pipelined")
        return boundary, (lambda: boundary.close(wait=False),)  # closed under the engine's lock


def _token_wise_over_holes(spec: RestoreSpec, loader: KVLoader) -> RestoreSpec:
    """Layer-wise over a prefix with holes goes token-wise (`KVLoader.absent_chunks`), and says so."""
    if spec.mode != "layer":
        return spec
    holes = loader.absent_chunks()
    if not holes:
        return spec
    shown = ", ".join(map(str, holes[:8])) + (", ..." if len(holes) > 8 else "")
    reason = f"chunks {shown} of {len(loader.keys)} absent from storage: token-wise, not layer-wise"
    return replace(spec, mode="token", fallback="; ".join(filter(None, (spec.fallback, reason))))


def _units(mode: str, n_tokens: int, unit_size: int, n_layers: int) -> list[tuple[int, int]]:
    """Each unit's token range: chunks of `unit_size` (token mode), or the whole prefix per layer."""
    if mode == "layer":
        return [(0, n_tokens)] * n_layers if n_tokens else []  # an empty prefix has nothing to restore
    return [(a, min(a + unit_size, n_tokens)) for a in range(0, n_tokens, unit_size)]

