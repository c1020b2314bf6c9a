"""The step's one decider (`engine/step_plan.decide_step`), alone: forward work first, sliced to the step's
budget in arrival order; the batch scheduler asked for restore units in the room left (while forward work
waits, at most `beside_forward_tokens`); the units it names split by their request's mode."""

from __future__ import annotations

from typing import Any

import torch

from cacheflow_common.engine.step_plan import ForwardItem, StepBudget, decide_step
from cacheflow_common.sched.policies import make_policy
from cacheflow_common.sched.scheduler import BatchScheduler, ComputeTask
from tests.factories import tiny_model

HIDDEN = 8


class NamingScheduler(BatchScheduler):
    """Names the tasks it was given, and records the room each call was asked to fill."""

    def __init__(self, tasks: list[ComputeTask]) -> None:
        super().__init__(make_policy("cake"), n_stages=1)
        self.tasks = tasks
        self.rooms: list[int | None] = []

    def next_compute_batch(self, stage: int, max_tokens: int | None = None, **_: Any) -> list[ComputeTask]:
        self.rooms.append(max_tokens)
        return self.tasks


def _item(request_id: str, rows: int, *, done: int = 0) -> ForwardItem:
    kv = tiny_model(num_layers=1).new_kv(range(1), rows)
    return ForwardItem(request_id=request_id, kv=kv, start=0, rows=torch.zeros(rows, HIDDEN), sample=None,
                       done_rows=done)


def _decide(forwards: list[ForwardItem], scheduler: BatchScheduler, *, step: int = 10, beside: int = 3,
            modes: dict[str, str] | None = None) -> Any:
    return decide_step(forwards, scheduler, StepBudget(step_tokens=step, beside_forward_tokens=beside), now=0.0,
                       ready=lambda _r, _u: True, mode_of=lambda r: (modes or {}).get(r, "token"))


def test_forward_work_fills_the_budget_in_arrival_order_and_restores_get_what_beside_allows():
    scheduler = NamingScheduler([])
    plan = _decide([_item("a", 4, done=1), _item("b", 9), _item("c", 2)], scheduler)
    assert [(item.request_id, a, b) for item, a, b in plan.forwards] == [("a", 1, 4), ("b", 0, 7)]
    assert plan.tokens == 10 and scheduler.rooms == [0]  # the forwards took the whole step


def test_without_forward_work_restores_get_the_whole_step():
    scheduler = NamingScheduler([])
    assert _decide([], scheduler, step=10, beside=3).empty and scheduler.rooms == [10]


def test_the_scheduler_units_split_by_their_requests_mode():
    scheduler = NamingScheduler([ComputeTask("t", 0), ComputeTask("l", 2), ComputeTask("t", 1)])
    plan = _decide([_item("f", 2)], scheduler, modes={"l": "layer"})
    assert plan.token_units == [ComputeTask("t", 0), ComputeTask("t", 1)] and plan.layer_units == [ComputeTask("l", 2)]
    assert scheduler.rooms == [3] and plan.request_ids() == {"f", "t", "l"} and not plan.empty
