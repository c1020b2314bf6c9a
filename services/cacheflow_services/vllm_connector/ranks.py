"""Pipeline-parallel vLLM ranks as CacheFlow stages: a rank's layer range, and the boundary activation
entering its first layer, captured while vLLM computes the prompt.

With `--pipeline-parallel-size N`, rank r holds the decoder layers [a, b) (`vllm.distributed.utils.
get_pp_indices`), exactly a CacheFlow stage. Rank r > 0 receives from rank r-1 the `IntermediateTensors`
{"hidden_states", "residual"}; vLLM's Llama/Qwen decoder layers fold the residual in at their input norm,
so the residual stream entering layer a is hidden_states + residual: CacheFlow's boundary activation.
`BoundaryCapture` takes it from a forward pre-hook on vLLM's top-level model (outside the region vLLM
compiles) and keeps each request's prompt rows until their chunks are stored. Whose row is which, at which
position, comes from the step's slot mapping in vLLM's forward context (each row's cache slot: block id x
block size + offset) and the blocks the scheduler gave each request (`PromptRows`, in the connector's
metadata): both runners set them, in any batch order, so nothing is read off the model runner.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cacheflow_common.errors import ConfigError
from cacheflow_services.vllm_connector.plan import PromptRows
from cacheflow_services.vllm_connector.vllm_runtime import draft_rows

log = logging.getLogger(__name__)


def tensor_parallel_agree(ok: bool) -> bool:
    """Whether `ok` holds on every tensor-parallel rank of this pipeline rank: a collective, so every rank of the
    group calls it, at the same point."""
    return bool(tensor_parallel_min([1 if ok else 0])[0])


def tensor_parallel_min(values: list[int]) -> list[int]:
    """Each of `values` at its least over this pipeline rank's tensor-parallel ranks (a MIN over vLLM's
    tensor-parallel group, on its CPU side): a collective, every rank of the group calls it at the same point
    with as many values."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    least = torch.tensor(values, dtype=torch.int64)  # [n]
    dist.all_reduce(least, op=dist.ReduceOp.MIN, group=get_tp_group().cpu_group)
    return [int(v) for v in least.tolist()]


@dataclass(frozen=True)
class RowShare:
    """How the tensor-parallel ranks of a pipeline rank share a prefix's stored rows (an EAGLE or MTP draft's
    inputs, the boundary activations entering a pipeline rank): every rank needs all of them (rows are not split
    by head, unlike KV), so rank r stores, and reads for a draft, the rows of every `ranks`-th chunk from its r-th
    (`mine`, by the chunk's index in its prefix: the same on every rank), and before a draft reruns the ranks add
    up what they read (`gather`). Each rank moves 1/`ranks` of the rows instead of all of them."""

    rank: int = 0
    ranks: int = 1

    def mine(self, chunk: int) -> bool:
        """Whether this rank stores and reads the rows of the prefix's chunk number `chunk`."""
        return chunk % self.ranks == self.rank

    def gather(self, rows: torch.Tensor, group: Any = None) -> torch.Tensor:
        """rows [T, W]: each chunk's rows where this rank holds them (`mine`), zeros elsewhere -> every chunk's
        rows, on every rank. Added up as bytes (a SUM over vLLM's tensor-parallel device group): each byte is one
        rank's and the others' zero, so the sum is exact. A collective: every rank calls it at the same point,
        with rows of the same shape and dtype (`group`: vLLM's by default)."""
        if self.ranks == 1 or rows.numel() == 0:
            return rows
        import torch.distributed as dist

        if group is None:
            from vllm.distributed.parallel_state import get_tp_group

            group = get_tp_group().device_group
        raw = rows.contiguous().view(torch.uint8)  # [T, W * itemsize]
        dist.all_reduce(raw, group=group)
        return raw.view(rows.dtype)  # [T, W]


ONE_RANK = RowShare()  # no tensor parallelism: the one rank stores and reads every chunk's rows


def rank_layers(layer_ids: Sequence[int], num_layers: int) -> range:
    """The contiguous layer range [a, b) of the attention layers vLLM hands one rank."""
    ids = sorted(layer_ids)
    if not ids or ids != list(range(ids[0], ids[-1] + 1)) or ids[0] < 0 or ids[-1] >= num_layers:
        raise ConfigError(f"vLLM's attention layers {ids} are not a contiguous range of the model's "
                          f"{num_layers} layers")
    return range(ids[0], ids[-1] + 1)


# an attention layer's name -> the slot mapping of the forward running now, [R] (-1 for padding rows)
StepSlots = Callable[[str], torch.Tensor]


class BoundaryCapture:
    """The residual stream entering a rank's first layer (or, attached with `output`, the rows the model returns),
    per request, by prompt position.

    Each step: `begin_step` says where its prompt rows go (`PromptRows`); `record` (the hook) files the
    rows by their slots; `take` returns a request's rows [start, end) once all are there; `release` /
    `finish` drop them.
    """

    def __init__(self, slots: StepSlots | None = None) -> None:
        self._slots = slots  # None: no step's slots can be read (not in vLLM), nothing is captured
        self._layer = ""  # the rank's attention layer whose slot mapping the hook reads
        self._step: PromptRows | None = None
        self._rows: dict[str, dict[int, torch.Tensor]] = {}  # request -> position -> [hidden] (on the CPU)
        self._lock = threading.Lock()
        self._handle: Any = None

    def attach(self, model: torch.nn.Module, layer: str, *, output: bool = False) -> None:
        """Hook vLLM's top-level model: its forward takes (input_ids, positions, intermediate_tensors, ...);
        `layer`: one of the rank's attention layers. `output`: capture what the model returns (the last rank's
        output rows, an EAGLE draft's input) instead of what it receives."""
        self._layer = layer
        if self._handle is None:
            self._handle = model.register_forward_hook(self._post_hook, with_kwargs=True) if output else \
                model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    @property
    def attached(self) -> bool:
        return self._handle is not None

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _pre_hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """What the rank before sent (hidden_states, residual). Never fails vLLM's forward."""
        inter = kwargs.get("intermediate_tensors", args[2] if len(args) > 2 else None)
        if inter is not None:  # None on rank 0 (no boundary)
            tensors = getattr(inter, "tensors", inter)  # vLLM's IntermediateTensors, or a plain dict
            self._record_step(lambda: (tensors["hidden_states"], tensors.get("residual")))

    def _post_hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        """The model's output rows [R, hidden] (a tensor on the last rank), or with an EAGLE-3 draft its auxiliary
        layers' residual streams, side by side [R, k * hidden]. Never fails vLLM's forward."""
        rows = draft_rows(output)[1]
        if isinstance(rows, torch.Tensor):  # not a rank before the last's IntermediateTensors
            self._record_step(lambda: (rows, None))

    def _record_step(self, rows: Callable[[], tuple[torch.Tensor, torch.Tensor | None]]) -> None:
        """File the step's prompt rows (hidden, residual) by their slots; a step it cannot read leaves its chunks
        without them."""
        if self._slots is None:  # a call not made by the runner
            return
        with self._lock:
            step, self._step = self._step, None
        if step is None or not step.blocks:  # nothing of a prompt this step (decodes only)
            return
        try:
            self.record(step, self._slots(self._layer), *rows())
        except Exception as exc:
            log.warning("no boundary activation captured this step (%s: %s)", type(exc).__name__, exc)

    def begin_step(self, rows: PromptRows) -> None:
        with self._lock:
            self._step = rows

    def record(self, step: PromptRows, slots: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
               ) -> None:
        """slots [R] (each row's cache slot, -1 for padding), hidden and residual [R, hidden] as rank r-1
        sends them."""
        if slots.dim() != 1 or slots.shape[0] > hidden.shape[0]:
            raise ValueError(f"a slot mapping of shape {tuple(slots.shape)} for {hidden.shape[0]} rows")
        owners = [(row, owner) for row, slot in enumerate(slots.to("cpu").tolist())
                  if (owner := step.owner(slot)) is not None]
        if not owners:
            return
        rows = torch.tensor([row for row, _ in owners], device=hidden.device)
        stream = hidden[rows] if residual is None else hidden[rows] + residual[rows]  # [n, hidden]
        stream = stream.detach().to("cpu", copy=True)
        with self._lock:
            for (_, (req_id, position)), row_stream in zip(owners, stream, strict=True):
                self._rows.setdefault(req_id, {})[position] = row_stream

    def take(self, req_id: str, start: int, end: int) -> torch.Tensor | None:
        """Rows for positions [start, end) of a request, [end - start, hidden], or None if any is missing."""
        with self._lock:
            kept = self._rows.get(req_id, {})
            if any(p not in kept for p in range(start, end)):
                return None
            return torch.stack([kept[p] for p in range(start, end)])

    def release(self, req_id: str, end: int) -> None:
        """Drop a request's rows before `end` (stored). The rows it keeps (past its last stored chunk, until
        the next step's complete it) are copied out of their step's tensor, which a view would keep whole."""
        with self._lock:
            kept = self._rows.get(req_id, {})
            for p in [p for p in kept if p < end]:
                del kept[p]
            if kept:
                positions = sorted(kept)
                kept.update(zip(positions, torch.stack([kept[p] for p in positions]), strict=True))  # [n, hidden]

    def finish(self, req_id: str) -> None:
        with self._lock:
            self._rows.pop(req_id, None)
