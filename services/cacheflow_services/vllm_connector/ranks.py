"""Pipeline-parallel vLLM ranks as CacheFlow stages: a rank's layer range, and the boundary activation
entering its first layer, captured while vLLM computes the prompt.

With `--pipeline-parallel-size N`, rank r holds the decoder layers [a, b) (`vllm.distributed.utils.
get_pp_indices`), exactly a CacheFlow stage. Rank r > 0 receives from rank r-1 the `IntermediateTensors`
{"hidden_states", "residual"}; vLLM's Llama/Qwen decoder layers fold the residual in at their input norm,
so the residual stream entering layer a is hidden_states + residual: CacheFlow's boundary activation.
`BoundaryCapture` takes it from a forward pre-hook on vLLM's top-level model (outside the region vLLM
compiles), row by row, with the rows' positions, and keeps each request's prompt rows until their
chunks are stored.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch

from cacheflow_common.errors import ConfigError

log = logging.getLogger(__name__)


def rank_layers(layer_ids: Sequence[int], num_layers: int) -> range:
    """The contiguous layer range [a, b) of the attention layers vLLM hands one rank."""
    ids = sorted(layer_ids)
    if not ids or ids != list(range(ids[0], ids[-1] + 1)) or ids[0] < 0 or ids[-1] >= num_layers:
        raise ConfigError(f"vLLM's attention layers {ids} are not a contiguous range of the model's "
                          f"{num_layers} layers")
    return range(ids[0], ids[-1] + 1)


class BoundaryCapture:
    """The residual stream entering a rank's first layer, per request, by prompt position.

    Each step: `begin_step` says which requests the step's rows belong to, in vLLM's batch order (request
    id, rows scheduled, prompt length); `record` (the pre-hook) files the rows; `take` returns a request's
    rows [start, end) once all are there; `release` / `finish` drop them.
    """

    def __init__(self) -> None:
        self._order: list[tuple[str, int, int]] = []
        self._rows: dict[str, dict[int, torch.Tensor]] = {}  # request -> position -> [hidden] (on the CPU)
        self._lock = threading.Lock()
        self._handle: Any = None

    def attach(self, model: torch.nn.Module) -> None:
        """Hook vLLM's top-level model: its forward takes (input_ids, positions, intermediate_tensors, ...)."""
        if self._handle is None:
            self._handle = model.register_forward_pre_hook(self._pre_hook, with_kwargs=True)

    @property
    def attached(self) -> bool:
        return self._handle is not None

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _pre_hook(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Never fails vLLM's forward: a step it cannot read leaves its chunks without a boundary."""
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        inter = kwargs.get("intermediate_tensors", args[2] if len(args) > 2 else None)
        if positions is None or inter is None:  # rank 0 (no boundary), or a call not made by the runner
            return
        try:
            tensors = getattr(inter, "tensors", inter)  # vLLM's IntermediateTensors, or a plain dict
            self.record(positions, tensors["hidden_states"], tensors.get("residual"))
        except Exception as exc:
            with self._lock:
                self._order = []
            log.warning("no boundary activation captured this step (%s: %s)", type(exc).__name__, exc)

    def begin_step(self, order: Sequence[tuple[str, int, int]]) -> None:
        with self._lock:
            self._order = list(order)

    def record(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None) -> None:
        """positions [R] (R >= the step's rows: padding rows at the end are ignored), hidden and residual
        [R, hidden] as rank r-1 sends them."""
        with self._lock:
            order, self._order = self._order, []
        rows = sum(n for _, n, _ in order)
        if rows == 0:
            return
        stream = hidden[:rows] if residual is None else hidden[:rows] + residual[:rows]  # [rows, hidden]
        if positions.dim() != 1:  # M-RoPE's [3, R]: not the rows' token positions
            raise ValueError(f"positions of shape {tuple(positions.shape)}: the boundary needs [R] token positions")
        stream, pos = stream.detach().to("cpu", copy=True), positions[:rows].to("cpu").tolist()
        first = 0
        with self._lock:
            for req_id, n, prompt_len in order:
                kept = self._rows.setdefault(req_id, {})
                for row in range(first, first + n):
                    if pos[row] < prompt_len:  # decode rows are never stored
                        kept[pos[row]] = stream[row]
                first += n

    def take(self, req_id: str, start: int, end: int) -> torch.Tensor | None:
        """Rows for positions [start, end) of a request, [end - start, hidden], or None if any is missing."""
        with self._lock:
            kept = self._rows.get(req_id, {})
            if any(p not in kept for p in range(start, end)):
                return None
            return torch.stack([kept[p] for p in range(start, end)])

    def release(self, req_id: str, end: int) -> None:
        """Drop a request's rows before `end` (stored)."""
        with self._lock:
            kept = self._rows.get(req_id, {})
            for p in [p for p in kept if p < end]:
                del kept[p]

    def finish(self, req_id: str) -> None:
        with self._lock:
            self._rows.pop(req_id, None)
