"""The fronts of planned restores (`planned_split.py`), recomputed with vLLM's model over one or more of vLLM's
steps, as vLLM's chunked prefill spreads a long prompt.

The restores a step starts share forwards: each forward takes the next slice of every front, in the step's
order, up to `prefill_tokens` in all (`front_forwards`), so a step with several restores runs as few forwards
as their tokens need. The forwards run in steps of at most `step_tokens` tokens (`front_steps`): the first in
the step that starts the restores, the next one per later step, with vLLM's other requests stepping between
(their decoding waits for one step's slices, not for whole fronts; `planned_loads.py` runs the steps, all
that are left at once in a step with nothing else to run). On tensor-parallel ranks those forwards
run the ranks' collectives, so every rank must run the same ones in the same step: the steps are fixed when
the restores start, from what every rank agreed on (the fronts, the token budget), and a restore's slices
are left out only when vLLM finished its request, which every rank learns in the same step.

A pipeline rank after the first starts its fronts from their stored boundary activations, read before any
forward (and before the backs start loading): a forward must not depend on a read either. Its tensor-parallel
ranks each read the rows of every TP-th chunk (`ranks.RowShare`, as they saved them) and agree that every one of
them read its own (`agree`, a collective over vLLM's tensor-parallel group) before they add them up; if one
could not, the step's restores fail on every rank alike, and vLLM recomputes them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from cacheflow_common.model.transformer import Span
from cacheflow_common.restore.boundary import BoundaryInput, BoundaryMissingError
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.vllm_connector.ranks import ONE_RANK, RowShare
from cacheflow_services.vllm_connector.vllm_runtime import VllmRuntime

if TYPE_CHECKING:
    from cacheflow_services.vllm_connector.planned_split import SplitPlan

FrontInput = Callable[[int, int], torch.Tensor]  # positions [a, b) -> the rows entering the rank's first layer
Forward = list[tuple[int, int, int]]  # (plan, a, b): the slice [a, b) of each plan's front it recomputes


def front_forwards(fronts: Sequence[tuple[int, int]], prefill_tokens: int) -> list[Forward]:
    """The forwards that recompute every front [start, front) of `fronts`, in order: each a list of (plan, a, b),
    the next slice [a, b) of each unfinished front in turn until `prefill_tokens` are taken (a slice attends over
    the ones before it in the blocks, so a front appears at most once per forward)."""
    at = [start for start, _ in fronts]
    forwards = []
    while any(a < end for a, (_, end) in zip(at, fronts, strict=True)):
        room, forward = prefill_tokens, []
        for i, (_, end) in enumerate(fronts):
            if at[i] < end and room > 0:
                b = min(end, at[i] + room)
                forward.append((i, at[i], b))
                room -= b - at[i]
                at[i] = b
        forwards.append(forward)
    return forwards


def step_token_budget(vllm_config: Any) -> int | None:
    """The most tokens vLLM's scheduler gives one request's prefill in a step, which a front's step takes too:
    `long_prefill_token_threshold` where it is set, else the step's whole budget (`max_num_batched_tokens`);
    None without vLLM's config (no limit)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    if scheduler is None:
        return None
    threshold = getattr(scheduler, "long_prefill_token_threshold", 0) or 0
    return int(threshold) if threshold > 0 else int(scheduler.max_num_batched_tokens)


def front_steps(forwards: Sequence[Forward], step_tokens: int | None) -> list[list[Forward]]:
    """`forwards`, in order, grouped into vLLM steps of at most `step_tokens` tokens each (None: all in one);
    a forward larger than the budget takes a step of its own."""
    steps: list[list[Forward]] = []
    taken = 0
    for forward in forwards:
        tokens = sum(b - a for _, a, b in forward)
        if not steps or (step_tokens is not None and taken + tokens > step_tokens):
            steps.append([])
            taken = 0
        steps[-1].append(forward)
        taken += tokens
    return steps


class Fronts:
    """The fronts of the planned restores one step started, recomputed step by step (`step`) into their blocks.
    `on_done(seconds)`: called once the last step ran, with the forwards' time, if every front was recomputed."""

    def __init__(self, plans: Sequence[SplitPlan], inputs: Sequence[FrontInput | None], model: VllmRuntime | None,
                 *, prefill_tokens: int, step_tokens: int | None,
                 on_done: Callable[[float], None] = lambda seconds: None) -> None:
        self.plans = plans
        self._inputs = inputs
        self._model = model
        budget = prefill_tokens if step_tokens is None else max(1, min(prefill_tokens, step_tokens))
        self._steps = deque(front_steps(front_forwards([(p.start, p.front) for p in plans], budget), step_tokens))
        self.plan_steps = [0] * len(plans)  # per plan, the vLLM steps its front's slices ran in so far
        self._dropped: set[int] = set()  # plans whose request vLLM finished: their slices are left out
        self._on_done = on_done
        self.error: BaseException | None = None  # what a forward raised (every plan's front failed with it)
        self.elapsed_s = 0.0  # the forwards' time so far
        # per plan, the bytes of boundary activations this rank read for its front (a later pipeline rank's)
        self.boundary_bytes_read = [x.bytes_read if isinstance(x, Boundary) else 0 for x in inputs]

    @property
    def pending(self) -> bool:
        """Steps remain to be run (for a plan vLLM has not finished)."""
        return bool(self._steps) and self.error is None and len(self._dropped) < len(self.plans)

    def drop(self, plan: int) -> None:
        """Leave out the rest of plan `plan`'s front (vLLM finished its request: its blocks may be another's)."""
        self._dropped.add(plan)

    def step(self, *, rest: bool = False) -> None:
        """Run the next step's forwards, in this vLLM step (`rest`: every step left); raises what a forward raised,
        keeping it in `error`."""
        began = time.perf_counter()
        ran: set[int] = set()
        try:
            while self.pending:
                for forward in self._steps.popleft():
                    forward = [(i, a, b) for i, a, b in forward if i not in self._dropped]
                    self._forward(forward)
                    ran.update(i for i, _, _ in forward)
                if not rest:
                    break
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.elapsed_s += time.perf_counter() - began
            for plan in ran:
                self.plan_steps[plan] += 1
        if not self._steps and not self._dropped:
            self._on_done(self.elapsed_s)

    def _forward(self, forward: Forward) -> None:
        """vLLM's model over the slices of one forward, from their inputs, each slice's KV into its blocks."""
        if not forward:
            return
        model = self._model
        assert model is not None  # front_inputs checked it
        hidden = torch.cat([_input(self._inputs[i])(a, b) for i, a, b in forward])  # [sum of b - a, hidden]
        spans = [Span(self.plans[i].kv, a, b - a) for i, a, b in forward]  # each slice's KV into its request's blocks
        model.forward_layers(hidden, self.plans[forward[0][0]].job.layers, spans)


def front_inputs(plans: Sequence[SplitPlan], store: ChunkStore, model: VllmRuntime | None,
                 agree: Callable[[bool], bool], share: RowShare = ONE_RANK) -> list[FrontInput | None]:
    """Per plan, what its front's forwards start from (None: it has no front). A later pipeline rank reads its
    fronts' boundary activations here, and, where any plan reads some, `agree` says whether every
    tensor-parallel rank read all of its own (the same plans on each: all call it, or none); if any rank
    could not, the step's restores fail here, on every rank, before a forward or a load starts. Under tensor
    parallelism each rank reads the chunks `share` gives it and the ranks then add up what they read
    (`RowShare.gather`, once for the step's plans, only where they agreed)."""
    if model is None:
        if any(plan.front > plan.start for plan in plans):
            raise RuntimeError("a planned front needs vLLM's model")
        return [None] * len(plans)
    boundaries: list[Boundary | None] = []
    error: Exception | None = None
    for plan in plans:
        try:
            boundaries.append(_boundary_rows(plan, store, model, share))
        except Exception as exc:  # missing, wrong, or its pod unreachable: this rank must still answer `agree`
            error = exc
            boundaries.append(None)
    reads = any(_reads_boundary(plan) for plan in plans)
    if not (agree(error is None) if reads else error is None):  # every rank calls `agree`, failed or not
        raise error or BoundaryMissingError("another tensor-parallel rank could not read a boundary activation")
    gathered = _gathered(boundaries, share)
    return [_front_input(plan, model, boundary) for plan, boundary in zip(plans, gathered, strict=True)]


@dataclass(frozen=True)
class Boundary:
    """A later pipeline rank's front input: its boundary rows from position `first` on, and the bytes this rank
    read from storage for them."""

    first: int
    rows: torch.Tensor  # [front - first, hidden]
    bytes_read: int

    def __call__(self, a: int, b: int) -> torch.Tensor:
        return self.rows[a - self.first : b - self.first]  # positions [a, b): [b - a, hidden]


def _reads_boundary(plan: SplitPlan) -> bool:
    return plan.job.layers.start > 0 and plan.front > plan.start


def _boundary_rows(plan: SplitPlan, store: ChunkStore, model: VllmRuntime, share: RowShare) -> Boundary | None:
    """A later pipeline rank's stored boundary activations for the plan's front, from the chunk holding its start
    (read now: BoundaryMissingError if one is missing or wrong): those of the chunks `share` gives this rank,
    zeros elsewhere. None on the first rank, or without a front."""
    job = plan.job
    if not _reads_boundary(plan):
        return None
    first = max(key.token_start for key in job.keys if key.token_start <= plan.start)  # the chunk holding `start`
    keys = [key for key in job.keys if first <= key.token_start < plan.front]
    with BoundaryInput(job, store, device=model.device, prefetch=0) as boundary:
        parts = [boundary(key.token_start, key.token_end).to(model.dtype) if share.mine(key.index)
                 else torch.zeros(key.n_tokens, model.config.hidden_size, dtype=model.dtype, device=model.device)
                 for key in keys]  # [n_tokens, hidden] each
    return Boundary(first, torch.cat(parts), boundary.bytes_read)  # rows [front - first, hidden]


def _gathered(boundaries: Sequence[Boundary | None], share: RowShare) -> list[Boundary | None]:
    """`boundaries` with every rank's share added up, in one `RowShare.gather` (every rank holds the same plans,
    so the same rows' shapes, in the same order)."""
    read = [boundary.rows for boundary in boundaries if boundary is not None]
    if share.ranks == 1 or not read:
        return list(boundaries)
    pieces = iter(share.gather(torch.cat(read)).split([rows.shape[0] for rows in read]))  # [T_i, hidden] each
    return [None if boundary is None else replace(boundary, rows=next(pieces)) for boundary in boundaries]


def _front_input(plan: SplitPlan, model: VllmRuntime, boundary: Boundary | None) -> FrontInput | None:
    """The plan's front input: its tokens' embeddings on the first pipeline rank; on a later one, its boundary
    activations."""
    if plan.front <= plan.start:
        return None
    if boundary is None:
        ids = torch.tensor(plan.job.token_ids, dtype=torch.long)  # [N]
        return lambda a, b: model.embed(ids[a:b])  # [b - a, hidden]
    return boundary


def _input(front_input: FrontInput | None) -> FrontInput:
    assert front_input is not None, "a plan with a front has an input"
    return front_input
