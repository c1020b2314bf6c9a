"""`CacheFlowConnector`: an out-of-tree vLLM v1 KV connector (vLLM 0.32) backed by CacheFlow.

    --kv-transfer-config '{"kv_connector": "CacheFlowConnector",
                           "kv_connector_module_path": "cacheflow_services.vllm_connector.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"pods": ["cacheflow-storage-0=10.0.0.5:7400"],
                                                         "tenant": "acme", "pod_token_file": "/etc/cacheflow/tokens"}}'

(a pod's id is the name the operator gives it, `<cluster>-storage-<i>`: placement hashes the ids, so they are
the same on every client; `helm install` prints the list)

The protocol, as vLLM drives it (`vllm/distributed/kv_transfer/kv_connector/v1/base.py`):
  scheduler: get_num_new_matched_tokens (a hit, loaded asynchronously by default: the request waits in
             WAITING_FOR_REMOTE_KVS) -> update_state_after_alloc (its blocks) -> build_connector_meta (per
             step: the loads to start) -> request_finished
  worker:    start_load_kv (starts background restores; with `async_loads: false`, restores in the step,
             before the forward) -> forward -> wait_for_save (copy the finished chunks out, store them in
             the background) -> get_finished (the background restores that ended: vLLM schedules those
             requests) -> get_block_ids_with_load_errors (vLLM recomputes those blocks)
Only this module imports vLLM's Python API when it loads (`vllm_runtime.py` and `adapters.py` call vLLM's
model, attention metadata builders and LoRA manager as they run; `paged_attention.py` its compiled CPU
attention ops); the logic lives in `plan.py` (scheduler), `worker.py` and `async_loads.py` (worker).

Pipeline parallelism (`--pipeline-parallel-size N`): every rank's worker connector holds that rank's layers,
a CacheFlow stage (worker.py, ranks.py); the scheduler looks prefixes up for the ranks' split, and each step
tells the ranks where its prompt rows go (their blocks), so a rank after the first can store the boundary
activation entering its first layer, and restores a rank's layers on its own: vLLM's model recomputes the
front over the rank's layers, a rank after the first starting from the stored boundary activations
(`vllm_runtime.py`), while the back loads. The capture is a forward pre-hook on vLLM's top-level model, outside
the region vLLM compiles, which files each row by its slot in the step's slot mapping (vLLM's forward
context, on both model runners); a step replayed as one full CUDA graph (pure decode batches) skips it, and a prompt row
computed in one leaves its chunk without a boundary activation (that rank then recomputes the prefix).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from cacheflow_common.errors import ConfigError
from cacheflow_common.store.prefix import cached_prefix_tokens
from cacheflow_services.vllm_connector.both_sides import StatsLog, blocks_from, open_store
from cacheflow_services.vllm_connector.config import ConnectorConfig
from cacheflow_services.vllm_connector.model_identity import (
    KVGeometry,
    chunk_fingerprint,
    fingerprint_needs_layout,
    head_split,
    salted,
)
from cacheflow_services.vllm_connector.paged import draft_model_layer
from cacheflow_services.vllm_connector.plan import Keying, LoadSpec, PromptRows, SaveSpec, SchedulerPlan
from cacheflow_services.vllm_connector.support import (
    OnceLog,
    declined,
    draft_reads_rows,
    draft_sources,
    model_dir,
    request_keying,
    unsupported,
    unsupported_cache,
)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from cacheflow_services.vllm_connector.worker import WorkerEngine

log = logging.getLogger(__name__)


@dataclass
class CacheFlowMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)  # restored in the step, before its forward
    background_loads: list[LoadSpec] = field(default_factory=list)  # started now, reported by get_finished
    saves: list[SaveSpec] = field(default_factory=list)
    scheduled: dict[str, int] = field(default_factory=dict)  # request -> its rows this step
    prompt_rows: PromptRows | None = None  # where the step's prompt rows go, where pipeline ranks capture them
    finished: list[str] = field(default_factory=list)


class CacheFlowConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        model_config = vllm_config.model_config
        self.cfg = ConnectorConfig.from_extra(dict(transfer.kv_connector_extra_config or {}),
                                              served_model=model_config.model)
        if transfer.kv_load_failure_policy != "recompute":
            log.warning("kv_load_failure_policy is %r: a failed CacheFlow load fails the request instead of "
                        "being recomputed; set it to \"recompute\"", transfer.kv_load_failure_policy)
        self._role = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._stats = StatsLog(self.cfg.stats_file)
        self._once = OnceLog()
        self._plan: SchedulerPlan | None = None
        self._engine: WorkerEngine | None = None
        self._load_errors: set[int] = set()
        self._refused: set[str] = set()  # worker side: background loads refused, reported by the next get_finished
        self._declined: set[str] = set()  # scheduler side: requests the connector neither restores nor stores
        pipeline = vllm_config.parallel_config.pipeline_parallel_size > 1
        # ranks after the first capture boundary activations; with an EAGLE or MTP draft, the model's output rows
        self._captured = (pipeline or draft_reads_rows(vllm_config)) and self.cfg.save
        # Restores have their meeting point planned before they start under tensor parallelism (a rank's forward
        # needs every other rank's in lockstep: planned_split.py).
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            log.info("CacheFlow restores with a meeting point planned up front (tensor parallelism)")
        self.inactive = self._resolve_model(model_config.revision) \
            or unsupported(vllm_config, self.cfg.model, self.cfg.runtime) or unsupported_cache(kv_cache_config)
        try:  # the scheduler's chunk keys need the layout only for an fp8 cache (model_identity.py)
            isa, layout = _cache_layout(vllm_config, exact=role != KVConnectorRole.SCHEDULER
                                        or fingerprint_needs_layout(vllm_config))
        except ConfigError as exc:
            self.inactive = self.inactive or str(exc)
        if self.inactive:
            self._step_aside(self.inactive)
            return
        block_size = vllm_config.cache_config.block_size
        dtype = model_config.dtype
        if role == KVConnectorRole.SCHEDULER:
            self._plan = _scheduler_plan(self.cfg, vllm_config, layout)
        else:
            from cacheflow_services.vllm_connector.worker import WorkerEngine  # the worker's side only

            device = "cpu" if vllm_config.device_config.device_type == "cpu" else "cuda"
            self._engine = WorkerEngine(self.cfg, dtype=dtype, block_size=block_size, device=device, layout=layout,
                                        vllm_model=lambda: find_vllm_model(vllm_config),
                                        layers=_rank_layers(vllm_config), attention_isa=isa,
                                        vllm_config=vllm_config, tp_rank=_tp_rank(vllm_config),
                                        step_slots=forward_context_slots,
                                        lora_manager=lambda model: find_lora_manager(vllm_config, model),
                                        drafter=find_drafter)

    def _resolve_model(self, revision: str | None) -> str:
        """Point `cfg.model` at the checkpoint's directory (a Hub id resolved in the local cache); the reason
        the connector must step aside if it cannot."""
        try:
            self.cfg = replace(self.cfg, model=str(model_dir(self.cfg.model, revision)))
        except ConfigError as exc:
            return str(exc)
        return ""

    def _step_aside(self, reason: str) -> None:
        """Serve nothing, once and for all: vLLM computes every request as it would without the connector."""
        self.inactive = reason
        self._engine = None
        self._once.warn("the CacheFlow connector steps aside; vLLM computes every prompt itself: %s", reason)
        self._stats.event("inactive", role=self._role, reason=reason)

    # ------------------------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """The tokens CacheFlow can restore past vLLM's own hit, and whether it restores them in the background
        (`async_loads`: the request waits in WAITING_FOR_REMOTE_KVS while the batch goes on; on tensor-parallel
        ranks its front is recomputed in the step that starts it, `planned_loads.py`)."""
        keying = self._keying(request) if self._plan is not None else None
        if self._plan is None or keying is None:
            return 0, False
        matched = self._plan.matched(request.request_id, list(request.prompt_token_ids or ()), num_computed_tokens,
                                     keying)
        return matched, matched > 0 and self.cfg.async_loads

    def _keying(self, request: Request) -> Keying | None:
        """How the request's chunks are keyed, or None where the connector leaves it to vLLM (said once per
        request, logged once per reason; worked out at the first ask: a waiting request is asked every step)."""
        if request.request_id in self._declined:
            return None
        if self._plan is not None and (known := self._plan.known_keying(request.request_id)) is not None:
            return known
        try:
            reason, keying = declined(request), request_keying(request)
        except ConfigError as exc:  # a LoRA adapter whose files cannot be read
            reason, keying = str(exc), Keying()
        if not reason:  # CacheFlow's runtime has no LoRA adapters: a LoRA request's restores load only
            return replace(keying, load_only=True) if keying.adapter and self.cfg.runtime != "vllm" else keying
        self._declined.add(request.request_id)
        self._once.warn("the CacheFlow connector leaves requests to vLLM: %s", reason)
        self._stats.event("declined", req=request.request_id, reason=reason)
        return None

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._plan is None or request.request_id in self._declined:
            return
        if self.cfg.async_loads:
            self._plan.allocated_in_background(request.request_id, list(request.prompt_token_ids or ()),
                                               blocks.get_block_ids()[0], num_external_tokens)
        else:
            self._plan.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        plan, meta = self._plan, CacheFlowMetadata()
        if plan is None:
            return meta
        if self._captured:
            meta.prompt_rows = PromptRows(plan.block_size)
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._declined:
                continue
            specs = plan.new_request(new.req_id, list(new.prompt_token_ids or ()), new.block_ids[0],
                                     new.num_computed_tokens + scheduled.get(new.req_id, 0))
            _add(meta, *specs)
            self._add_rows(meta, new.req_id, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            specs = plan.running_request(req_id, blocks[0] if blocks else None,
                                         resumed=req_id in cached.resumed_req_ids,
                                         computed_after=cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
            _add(meta, *specs)
            self._add_rows(meta, req_id, cached.num_computed_tokens[i], scheduled.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            plan.finished(req_id)
            self._declined.discard(req_id)
        meta.background_loads = plan.take_background_loads()
        meta.scheduled = dict(scheduled)
        meta.finished = list(scheduler_output.finished_req_ids)
        return meta

    def _add_rows(self, meta: CacheFlowMetadata, req_id: str, computed: int, rows: int) -> None:
        """Where the request's rows this step go, when pipeline ranks capture boundary activations (or the worker
        an EAGLE draft's input rows)."""
        if meta.prompt_rows is not None and self._plan is not None:
            self._plan.add_prompt_rows(meta.prompt_rows, req_id, computed, computed + rows)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._plan is not None:
            self._plan.finished(request.request_id)
        self._declined.discard(request.request_id)
        return False, None  # saves copy their KV out in wait_for_save: the blocks can go now

    # ------------------------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._engine is None:
            return
        try:
            self._engine.register(kv_caches)
        except ConfigError as exc:  # caches the connector cannot read (a rank's head slice, kernel blocks)
            engine = self._engine
            self._step_aside(f"vLLM's KV caches: {exc}")
            engine.close()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward, on both of vLLM's model runners (`start_load_kv` may come after it): a
        rank that captures boundary activations learns where the step's prompt rows go."""
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if self._engine is not None and isinstance(meta, CacheFlowMetadata) and meta.prompt_rows is not None:
            self._engine.begin_step(meta.prompt_rows)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CacheFlowMetadata)
        if self._engine is None:
            self._refuse(meta.loads, meta.background_loads)
            return
        if meta.loads:
            self._load_errors |= self._engine.load_step(meta.loads)
        if meta.background_loads:
            self._engine.start_loads(meta.background_loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv restores every layer before the forward pass starts

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # whole chunks are copied out in wait_for_save, once per step

    def _refuse(self, loads: list[LoadSpec], background: list[LoadSpec]) -> None:
        """A worker that stepped aside after its scheduler planned loads: every one fails, vLLM recomputes."""
        for spec in [*loads, *background]:
            self._load_errors |= blocks_from(spec, spec.start, self._vllm_config.cache_config.block_size)
            self._stats.event("declined", req=spec.req_id, reason=self.inactive)
        self._refused.update(spec.req_id for spec in background)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CacheFlowMetadata)
        if self._engine is None:
            return
        for spec in meta.saves:
            self._engine.save(spec)
        self._engine.finished(meta.finished)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None: saves never hold blocks, the background restores that ended): vLLM schedules those
        requests next; the blocks any of them failed to restore go out with this same pass's load errors."""
        if self._engine is None:
            refused, self._refused = self._refused, set()
            return None, refused or None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, CacheFlowMetadata) and not meta.scheduled
        done, failed = self._engine.finished_loads(finished_req_ids, idle=idle)
        self._load_errors |= failed
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def flush(self) -> None:
        """Wait for the saves queued so far (drivers call it before they exit)."""
        if self._engine is not None:
            self._engine.flush()

    def shutdown(self) -> None:
        if self._engine is not None:
            self._engine.close()


def _add(meta: CacheFlowMetadata, load: LoadSpec | None, save: SaveSpec | None) -> None:
    if load is not None:
        meta.loads.append(load)
    if save is not None:
        meta.saves.append(save)


def _cpu_attention_isa(vllm_config: VllmConfig) -> str:
    """The kernel vLLM's CPU attention backend runs for this model and cache (vec, vec16, amx, ...)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # the backend's own choice, private in 0.32

    model, cache = vllm_config.model_config, vllm_config.cache_config
    return str(_get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype))


def _cache_layout(vllm_config: VllmConfig, exact: bool = True) -> tuple[str, str]:
    """vLLM's CPU attention kernel ("" on a GPU) and how K and V sit in its cache's blocks (paged.py). Not
    `exact` (a scheduler whose chunk keys need no layout): ("", "") once the CPU is one whose kernels' layouts
    the connector knows, without importing vLLM's CPU attention backend (250 modules, 4 MiB in a process that
    does not otherwise load them: the driver of a tensor- or pipeline-parallel instance)."""
    if vllm_config.device_config.device_type != "cpu":
        return "", "split"
    if not exact:
        _check_cpu_architecture()
        return "", ""
    isa = _cpu_attention_isa(vllm_config)
    return isa, _paged_layout(isa)


def _check_cpu_architecture() -> None:
    """ConfigError unless vLLM's CPU attention runs one of its x86 kernels, whose block layouts the connector
    knows (`_paged_layout`; a rank also checks the exact kernel)."""
    from vllm.platforms import CpuArchEnum, current_platform

    arch = current_platform.get_cpu_architecture()
    if arch != CpuArchEnum.X86:
        raise ConfigError(f"the CacheFlow connector knows the KV layouts of vLLM's x86 CPU attention kernels only, "
                          f"not {arch.name}'s")


def _paged_layout(isa: str) -> str:
    """How vLLM's CPU attention kernel arranges K and V in a block: it depends on its ISA (paged.py)."""
    layouts = {"vec": "cpu-vec", "vec16": "cpu-vec", "amx": "cpu-plain"}  # measured on x86 (paged.py)
    if isa not in layouts:
        raise ConfigError(f"the CacheFlow connector does not know the KV layout of vLLM's CPU attention ISA {isa!r} "
                          f"(known: {', '.join(layouts)})")
    return layouts[isa]


def find_vllm_model(vllm_config: VllmConfig) -> Any:
    """vLLM's loaded model module, or None: the connector is handed no reference to it, so it is taken from
    the worker or model runner on the call stack (the connector is created, handed its caches and asked to
    load by them), and accepted only if it holds this engine's own attention layers."""
    attn_layers = {name: attn for name, attn in vllm_config.compilation_config.static_forward_context.items()
                   if not draft_model_layer(name)}  # the target's (and an EAGLE or MTP draft's)
    if not attn_layers:
        return None
    name, attn = min(attn_layers.items())  # e.g. "model.layers.0.self_attn.attn" -> its Attention module
    for owner in _vllm_owners():
        model = _model_of(owner)
        if model is not None and _holds(model, name, attn):
            return model
    return None


def find_lora_manager(vllm_config: VllmConfig, model: Any) -> Any:
    """The LoRA manager of the model runner holding `model` (vLLM's, as `find_vllm_model` found it): None
    without LoRA, or where neither that runner nor its worker is on the call stack."""
    if vllm_config.lora_config is None:
        return None
    for owner in _vllm_owners():
        for runner in (owner, getattr(owner, "model_runner", None)):  # a model runner, or a worker's
            manager = getattr(runner, "lora_manager", None)
            if manager is not None and _model_of(runner) is model:
                return manager
    return None


def find_drafter(model: Any) -> Any:
    """The draft model (an EAGLE or MTP draft, or a draft model) of the model runner holding `model`, or None
    where that runner is not on the call stack or has no draft model."""
    for owner in _vllm_owners():
        for runner in (owner, getattr(owner, "model_runner", None)):  # a model runner, or a worker's
            drafter = getattr(getattr(runner, "drafter", None), "model", None)
            if drafter is not None and _model_of(runner) is model:
                return drafter
    return None


def _vllm_owners() -> Iterator[Any]:
    """The `self` of every vLLM method on the call stack, innermost first."""
    frame = inspect.currentframe()
    while frame is not None:
        owner = frame.f_locals.get("self")
        if owner is not None and type(owner).__module__.startswith("vllm."):
            yield owner
        frame = frame.f_back


def _tp_rank(vllm_config: VllmConfig) -> int | None:
    """This worker's tensor-parallel rank (None without tensor parallelism)."""
    if vllm_config.parallel_config.tensor_parallel_size == 1:
        return None
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _rank_layers(vllm_config: VllmConfig) -> range | None:
    """This pipeline rank's layers by vLLM's split (None without pipeline parallelism, or before vLLM's
    groups exist); `register` checks them against the caches vLLM hands over."""
    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    if pp_size == 1:
        return None
    from vllm.distributed.parallel_state import get_pp_group
    from vllm.distributed.utils import get_pp_indices

    try:
        rank = get_pp_group().rank_in_group
    except AssertionError:  # the pipeline group is not initialized in this process
        return None
    return range(*get_pp_indices(KVGeometry.from_vllm(vllm_config).num_layers, rank, pp_size))


def forward_context_slots(layer: str) -> torch.Tensor:
    """The slot mapping vLLM's runner (V1 or V2) put in the forward context for `layer`'s KV cache group."""
    from vllm.forward_context import get_forward_context

    slots = get_forward_context().slot_mapping
    if not isinstance(slots, dict):
        raise ValueError("a micro-batched step (dual batch overlap) has one slot mapping per micro-batch")
    return slots[layer]


def _model_of(owner: Any) -> Any:
    """The unwrapped model a vLLM worker or model runner holds (`get_model()`), or None."""
    get_model = getattr(owner, "get_model", None)
    if not callable(get_model):
        return None
    try:
        return get_model()
    except Exception:  # not loaded yet, or not a worker / model runner after all
        return None


def _holds(model: Any, name: str, attn: Any) -> bool:
    try:
        return bool(model.get_submodule(name) is attn)
    except (AttributeError, TypeError):
        return False


def _scheduler_plan(cfg: ConnectorConfig, vllm_config: VllmConfig, layout: str) -> SchedulerPlan:
    """The scheduler's plan, looking prefixes up on the pods (the model's fingerprint, without its weights)
    with the chunk objects of every pipeline rank's layers."""
    from pathlib import Path

    from vllm.distributed.utils import get_pp_indices

    pp_size = vllm_config.parallel_config.pipeline_parallel_size
    block_size = vllm_config.cache_config.block_size
    fingerprint = chunk_fingerprint(Path(cfg.model), vllm_config, layout)
    num_layers = KVGeometry.from_vllm(vllm_config).num_layers
    kv_heads, split = vllm_config.model_config.get_total_num_kv_heads(), head_split(vllm_config)
    store = open_store(cfg)
    layers = [range(*get_pp_indices(num_layers, r, pp_size)) for r in range(pp_size)]

    def lookup(prompt: Any, limit: int, salt: str) -> int:
        """Tokens whose chunks every rank finds: the heads of each tensor-parallel rank, stored split as this
        instance's ranks split them or any other way, each later pipeline rank's boundary activations
        (without them that rank's restore fails) and the rows a restored draft reads (`draft_sources`)."""
        return cached_prefix_tokens(prompt, fingerprint=salted(fingerprint, salt), tenant=cfg.tenant,
                                    chunk_size=cfg.chunk_size, stage_layers=layers, store=store, limit=limit,
                                    kv_heads=kv_heads, head_split=split, boundaries=True,
                                    draft_rows=draft_sources(vllm_config, num_layers))  # its draft's input

    return SchedulerPlan(chunk_size=cfg.chunk_size, block_size=block_size, lookup=lookup, save=cfg.save)
