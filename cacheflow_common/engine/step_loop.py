"""The stage's compute loop: the one thread that runs its model. Each step reads like Algorithm 1:

    schedule     the step's one decision (`step_plan.decide_step`): forward work first, then the batch
                 scheduler's next compute unit of every restoring request, within the step's token budget
    run          ONE forward over the token rows of all of them (linear layers and MLP over the
                 concatenated tokens, attention per request over its own KV); layer units of
                 layer-wise restores after it, one layer over one prefix each; the last stage samples
    postprocess  report every unit computed and the step's time to the scheduler, answer the
                 forward work that is done, answer the restores that are done

A request whose unit cannot be computed (its boundary activation is missing or corrupt, its upstream
failed) fails alone; the others go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from cacheflow_common.engine.core import EngineCore, RestoreCancelledError
from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.engine.step_plan import ForwardItem, StepBudget, StepPlan
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.sched.scheduler import ComputeTask

log = logging.getLogger(__name__)

Sampler = Callable[[torch.Tensor, float, int, int], int]  # (logits [vocab], temperature, seed, position)


class StepLoop:
    def __init__(self, core: EngineCore, model: Transformer, layers: range, *, budget: StepBudget, sampler: Sampler,
                 on_step: Callable[[StepPlan, float], None]) -> None:
        self.core = core
        self.model = model
        self.layers = layers
        self.budget = budget
        self.sampler = sampler
        self.on_step = on_step  # metrics: told of every step and its seconds

    def run(self, until: Callable[[], bool] | None = None) -> None:
        """Step until the engine stops, or `until()` holds: the body of a loop thread (no `until`), or of a
        caller that drives its own restores on its own thread. A caller's `until` may turn true without the
        engine hearing of it (a time limit; a restore that failed before it reached the engine), so its
        waits for work are bounded and `until` checked again after each."""
        done = until or (lambda: False)
        while not self.core.has_stopped and not done():
            try:
                self.step(until=done, bounded=until is not None)
            except Exception:  # a bug, not a bad request: keep serving, fail nothing silently
                log.exception("compute step failed")

    def step(self, *, wait: bool = True, until: Callable[[], bool] = lambda: False, bounded: bool = False) -> bool:
        """One step; False when there was nothing to do (after waiting for work, if `wait`, unless `until()`
        holds by then: a restore the caller waits for may finish on a channel's thread; at most `IDLE_WAIT_S`
        if `bounded`)."""
        plan = self.core.next_step(self.budget, wait=wait, until=until, bounded=bounded)
        if plan is None:
            return False
        started = time.perf_counter()
        try:
            outputs, failed = self._run(plan)
        except Exception as exc:  # the batched forward itself failed: everything in it fails, the loop goes on
            log.exception("compute step failed; failing its requests %s", sorted(plan.request_ids()))
            self.core.fail_step(plan, exc)
            return True
        ended = time.perf_counter()
        self._postprocess(plan, outputs, failed, started, ended)
        self.on_step(plan, ended - started)
        return True

    # -- run ------------------------------------------------------------------------------------
    def _run(self, plan: StepPlan) -> tuple[list[torch.Tensor], dict[str, BaseException]]:
        """Rows out per forward slice and token unit (in plan order); the requests that failed, and why."""
        failed: dict[str, BaseException] = {}
        rows: list[torch.Tensor] = []
        spans: list[Span] = []
        for item, a, b in plan.forwards:
            rows.append(item.rows[a:b])  # [t, hidden]
            spans.append(Span(item.kv, item.start + a, b - a))
        for task in plan.token_units:
            try:
                x, span = self._restore(task).token_span(task.unit)
            except Exception as exc:  # its input is missing or corrupt: this request fails, not the step
                failed[task.request_id] = exc
                continue
            rows.append(x)
            spans.append(span)
        outputs: list[torch.Tensor] = []
        if rows:
            out = self.model.forward_layers(torch.cat(rows), self.layers, spans)  # [R, hidden]
            outputs = list(out.split([s.length for s in spans]))
        for task in plan.layer_units:
            try:
                self._restore(task).compute_layer(self.model, task.unit)
            except Exception as exc:
                failed[task.request_id] = exc
        return outputs, failed

    def _restore(self, task: ComputeTask) -> StageRestore:
        restore = self.core.restore_of(task.request_id)
        if restore is None:
            raise RestoreCancelledError(f"request {task.request_id!r} was released while it restored")
        return restore

    # -- postprocess ----------------------------------------------------------------------------
    def _postprocess(self, plan: StepPlan, outputs: list[torch.Tensor], failed: dict[str, BaseException],
                     started: float, ended: float) -> None:
        forward_out = outputs[: len(plan.forwards)]
        unit_out = iter(outputs[len(plan.forwards) :])
        computed = [(t, None if t.request_id in failed else next(unit_out, None)) for t in plan.token_units]
        computed += [(t, None) for t in plan.layer_units]
        self._answer(self.core.end_step(plan, forward_out, computed, failed, started, ended))

    def _answer(self, finished: list[ForwardItem]) -> None:
        """Hand each finished item its answer: the rows leaving the stage, or (last stage) a token."""
        sampled = [item for item in finished if item.sample is not None]
        if sampled:
            last_rows = torch.stack([item.outputs[-1][-1] for item in sampled])  # [B, hidden]
            logits = self.model.logits(last_rows)  # [B, vocab]
            for item, row in zip(sampled, logits, strict=True):
                temperature, seed = item.sample or (0.0, 0)
                position = item.start + item.rows.shape[0]
                try:
                    item.future.set_result(self.sampler(row, temperature, seed, position))
                except Exception as exc:  # this request's sampling failed: it gets the error, the others their tokens
                    item.future.set_exception(exc)
        for item in finished:
            if item.sample is None:
                item.future.set_result(torch.cat(item.outputs))  # [T, hidden]
