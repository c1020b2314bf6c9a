"""What one compute step runs, and the one rule that decides it (`decide_step`).

Forward work first (decode tokens, suffix-prefill slices, in arrival order), then the batch scheduler's
next compute unit of every restoring request within what is left of the step's token budget; while forward
work waits, restores get only `beside_forward_tokens` of the step (one unit at least): a request whose
prefix is restored is one forward from its first token, and a step full of other requests' restore units
would hold it for the whole step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.sched.scheduler import BatchScheduler, ComputeTask

STAGE = 0  # this engine's stage, as its own one-stage scheduler numbers it


@dataclass
class ForwardItem:
    """New tokens of one request through this stage: a suffix prefill (run in budget-sized slices) or
    one decode token. The answer is the hidden states leaving the stage, [T, hidden], or on the last
    stage the next token sampled from the last row."""

    request_id: str
    kv: KVBuffer
    start: int  # position of rows[0]
    rows: torch.Tensor  # [T, hidden]: the stage's input for the new tokens
    sample: tuple[float, int] | None  # last stage: (temperature, seed)
    done_rows: int = 0  # rows already run
    outputs: list[torch.Tensor] = field(default_factory=list)  # [t_i, hidden] per slice run
    future: Future[torch.Tensor | int] = field(default_factory=Future)

    @property
    def left(self) -> int:
        return self.rows.shape[0] - self.done_rows


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: slices (item, first row, end row) of forward work, and restore units."""

    forwards: list[tuple[ForwardItem, int, int]]
    token_units: list[ComputeTask]
    layer_units: list[ComputeTask]

    @property
    def tokens(self) -> int:
        return sum(b - a for _, a, b in self.forwards)

    @property
    def empty(self) -> bool:
        return not (self.forwards or self.token_units or self.layer_units)

    def request_ids(self) -> set[str]:
        """Every request with work in this step."""
        units = {t.request_id for t in (*self.token_units, *self.layer_units)}
        return units | {item.request_id for item, _, _ in self.forwards}


@dataclass(frozen=True, kw_only=True)
class StepBudget:
    step_tokens: int  # tokens per step (one restore unit always fits)
    beside_forward_tokens: int  # restore tokens a step may carry beside forward work


def decide_step(forwards: Iterable[ForwardItem], scheduler: BatchScheduler, budget: StepBudget, *, now: float,
                ready: Callable[[str, int], bool], mode_of: Callable[[str], str]) -> StepPlan:
    """The step's work: forward slices within the budget, then the scheduler's units in the room left.
    `ready(request, unit)`: compute may take the unit now; `mode_of(request)`: "token" or "layer"."""
    slices = _forward_slices(forwards, budget.step_tokens)
    room = budget.step_tokens - sum(b - a for _, a, b in slices)
    if slices:
        room = min(room, budget.beside_forward_tokens)
    tasks = scheduler.next_compute_batch(STAGE, room, now=now, ready=ready)
    token_units = [t for t in tasks if mode_of(t.request_id) == "token"]
    layer_units = [t for t in tasks if mode_of(t.request_id) == "layer"]
    return StepPlan(slices, token_units, layer_units)


def _forward_slices(forwards: Iterable[ForwardItem], step_tokens: int) -> list[tuple[ForwardItem, int, int]]:
    """Forward work in arrival order, sliced to fit the budget (decode tokens are one row each)."""
    slices = []
    budget = step_tokens
    for item in forwards:
        take = min(item.left, budget)
        if take <= 0:
            break
        slices.append((item, item.done_rows, item.done_rows + take))
        budget -= take
    return slices
