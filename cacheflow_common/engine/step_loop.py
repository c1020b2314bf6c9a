"""The stage's compute loop: the one thread that runs its model. Each step reads like Algorithm 1:

    schedule     forward work first (decode tokens, suffix-prefill slices), then the batch scheduler's
                 next compute unit of every restoring request, within the step's token budget; while
                 forward work waits, restores get only `beside_forward_tokens` of the step (one unit
                 at least): a request whose prefix is restored is one forward from its first token,
                 and a step full of other requests' restore units would hold it for the whole step
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
from dataclasses import dataclass

import torch

from cacheflow_common.engine.core import STAGE, EngineCore, ForwardItem, RestoreCancelledError
from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.sched.scheduler import ComputeTask

log = logging.getLogger(__name__)

Sampler = Callable[[torch.Tensor, float, int, int], int]  # (logits [vocab], temperature, seed, position)


@dataclass(frozen=True)
class StepPlan:
    """What one step runs: slices (item, first row, end row) of forward work, and restore units."""

    forwards: list[tuple[ForwardItem, int, int]]
    token_units: list[ComputeTask]
    layer_units: list[ComputeTask]

    @property
    def tokens(self) -> int:
        return sum(b - a for _, a, b in self.forwards)

    def request_ids(self) -> set[str]:
        """Every request with work in this step."""
        units = {t.request_id for t in (*self.token_units, *self.layer_units)}
        return units | {item.request_id for item, _, _ in self.forwards}


class StepLoop:
    def __init__(self, core: EngineCore, model: Transformer, layers: range, *, step_tokens: int,
                 beside_forward_tokens: int, sampler: Sampler, on_step: Callable[[StepPlan, float], None]) -> None:
        self.core = core
        self.model = model
        self.layers = layers
        self.step_tokens = step_tokens  # the step's token budget (one restore unit always fits)
        self.beside_forward_tokens = beside_forward_tokens  # restore tokens in a step that carries forward work
        self.sampler = sampler
        self.on_step = on_step  # metrics: told of every step and its seconds

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Step until the engine stops, or `until()` holds: the body of a loop thread, or of a caller that
        drives its own restores on its own thread."""
        while not self.core.stopped and not until():
            try:
                self.step(until=until)
            except Exception:  # a bug, not a bad request: keep serving, fail nothing silently
                log.exception("compute step failed")

    def step(self, *, wait: bool = True, until: Callable[[], bool] = lambda: False) -> bool:
        """One step; False when there was nothing to do (after waiting for work, if `wait`, unless `until()`
        holds by then: a restore the caller waits for may finish on a channel's thread)."""
        plan = self._schedule(wait, until)
        if plan is None:
            return False
        started = time.perf_counter()
        try:
            outputs, failed = self._run(plan)
        except Exception as exc:  # the batched forward itself failed: everything in it fails, the loop goes on
            log.exception("compute step failed; failing its requests %s", sorted(plan.request_ids()))
            self._fail_all(plan, exc)
            return True
        ended = time.perf_counter()
        self._postprocess(plan, outputs, failed, started, ended)
        self.on_step(plan, ended - started)
        return True

    # -- schedule -------------------------------------------------------------------------------
    def _schedule(self, wait: bool, until: Callable[[], bool]) -> StepPlan | None:
        core = self.core
        with core.cond:
            forwards = self._forward_slices()
            room = self.step_tokens - sum(b - a for _, a, b in forwards)
            if forwards:
                room = min(room, self.beside_forward_tokens)
            tasks = core.scheduler.next_compute_batch(STAGE, room, now=time.perf_counter(), ready=self._ready)
            if not forwards and not tasks:
                if wait and not until():  # checked under `cond`, where restores are answered
                    core.idle_wait()
                return None
            modes = {t.request_id: core.restores[t.request_id].spec.mode for t in tasks}
        token_units = [t for t in tasks if modes[t.request_id] == "token"]
        layer_units = [t for t in tasks if modes[t.request_id] == "layer"]
        return StepPlan(forwards, token_units, layer_units)

    def _forward_slices(self) -> list[tuple[ForwardItem, int, int]]:
        """Forward work in arrival order, sliced to fit the budget (decode tokens are one row each)."""
        slices = []
        budget = self.step_tokens
        for item in self.core.forwards:
            take = min(item.left, budget)
            if take <= 0:
                break
            slices.append((item, item.done_rows, item.done_rows + take))
            budget -= take
        return slices

    def _ready(self, request_id: str, unit: int) -> bool:
        """Compute may take `unit` now: its input is here and the channels have looked at its request."""
        restore = self.core.restores[request_id]
        return self.core.seen_by_channels(restore) and restore.ready(unit)

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
        with self.core.cond:
            restore = self.core.restores.get(task.request_id)
        if restore is None:
            raise RestoreCancelledError(f"request {task.request_id!r} was released while it restored")
        return restore

    def _fail_all(self, plan: StepPlan, error: BaseException) -> None:
        with self.core.cond:
            for task in (*plan.token_units, *plan.layer_units):
                self.core.fail(task.request_id, error)
            for item, _, _ in plan.forwards:
                if item in self.core.forwards:
                    self.core.forwards.remove(item)
                if not item.future.done():
                    item.future.set_exception(error)
            self.core.cond.notify_all()

    # -- postprocess ----------------------------------------------------------------------------
    def _postprocess(self, plan: StepPlan, outputs: list[torch.Tensor], failed: dict[str, BaseException],
                     started: float, ended: float) -> None:
        core = self.core
        forward_out = outputs[: len(plan.forwards)]
        unit_out = iter(outputs[len(plan.forwards) :])
        computed = [(t, None if t.request_id in failed else next(unit_out, None)) for t in plan.token_units]
        computed += [(t, None) for t in plan.layer_units]
        with core.cond:
            core.scheduler.step_done(STAGE, ended - started)
            for task, out in computed:
                restore = core.restores.get(task.request_id)
                if restore is None or task.request_id in failed:
                    continue
                restore.computed(task.unit, out, started, ended)
                core.scheduler.computed(STAGE, task.request_id, task.unit)
            for request_id, error in failed.items():
                core.fail(request_id, error)
            finished = self._advance_forwards(plan, forward_out)
            core.settle()
            core.cond.notify_all()
        self._answer(finished)

    def _advance_forwards(self, plan: StepPlan, outputs: list[torch.Tensor]) -> list[ForwardItem]:
        """Record each slice's rows; the items now complete leave the queue (the caller holds `cond`)."""
        finished = []
        for (item, _, b), out in zip(plan.forwards, outputs, strict=True):
            item.outputs.append(out)
            item.done_rows = b
            if item.left == 0:
                self.core.forwards.remove(item)
                finished.append(item)
        return finished

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
