"""What a stage engine's compute loop, its channel loaders and its request threads share, under one lock;
none of them touches it but through these methods.

* The batch scheduler (the same object the simulator drives) for this stage: stage 0 of a one-stage
  scheduler, since every worker schedules its own stage; its channels are the pods.
* The stage's requests (`requests.RequestTable`: one record each, keyed once; a restore is found through
  its request's record) and forward work waiting for the loop (suffix-prefill chunks and decode tokens), in
  arrival order. The table shares this lock.
* Settling hands every restore the scheduler finished or failed its answer.
* Channels look first: a new restore that loads computes nothing until every channel has asked the
  scheduler for work since it arrived (or is busy loading). Without this, the compute loop, already
  awake, would take units before an idle channel's thread is scheduled, and the meeting point would
  see no load in flight: a head start for compute that the scheduler (and the simulator) never meant.

Every change that could give a waiting thread work notifies the condition (`wake_loop`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from cacheflow_common.engine.pool import KVPool
from cacheflow_common.engine.requests import RequestTable
from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.engine.step_plan import STAGE, ForwardItem, StepBudget, StepPlan, decide_step
from cacheflow_common.errors import CacheFlowError
from cacheflow_common.sched.scheduler import BatchScheduler, ComputeTask, LoadTask

if TYPE_CHECKING:  # the engine need not load the grants' signature code (`engine/requests.py`)
    from cacheflow_common.auth import Grant

IDLE_WAIT_S = 0.05  # with restores in flight, a loop or channel with nothing to do re-checks this often

UnitComputed = tuple[ComputeTask, torch.Tensor | None]  # a unit the step ran, and its rows out [T, hidden]


class RestoreCancelledError(CacheFlowError):
    """The request was released (its client went away) while it restored."""


class EngineCore:
    """`pool`: where the stage's own requests get their KV (None: callers hand each restore its KV);
    `on_stream_closed`: a released request's delivery grant is used up."""

    def __init__(self, scheduler: BatchScheduler, *, stage: int, n_channels: int, pool: KVPool | None = None,
                 on_stream_closed: Callable[[Grant], None] = lambda grant: None) -> None:
        self._stage = stage  # the pipeline stage, for answers and errors
        self._channel_looks = [0] * n_channels  # how often each channel has asked the scheduler for work
        self._channel_loading = [False] * n_channels  # each channel: a load in flight
        self._cond = threading.Condition()  # reentrant: the table's calls take it again inside the core's
        self._scheduler = scheduler
        self._requests = RequestTable(self._cond, stage=stage, pool=pool, on_stream_closed=on_stream_closed,
                                      stop_restore=self._stop_released)
        self._forwards: deque[ForwardItem] = deque()
        self._stopped = False

    # -- request threads ----------------------------------------------------------------------------
    def request_table(self) -> RequestTable:
        return self._requests

    def admit_restore(self, restore: StageRestore) -> None:
        with self._cond:
            self._requests.start_restore(restore)
            restore.looks_at_admit = tuple(self._channel_looks)
            try:
                work = self._scheduler.arrive(restore.plan, restore.spec.policy)
            except BaseException:
                self._requests.end_restore(restore.request_id)
                raise
            restore.states = work.stages[STAGE].pointers.states
            self._settle()  # an empty prefix is done on arrival
            self._cond.notify_all()

    def cancel_restore(self, request_id: str, error: BaseException) -> bool:
        """Stop a restore still running (its waiter gets `error`); False if none runs for the request."""
        with self._cond:
            if self._requests.restore_of(request_id) is None:
                return False
            self._fail(request_id, error)
            self._cond.notify_all()
            return True

    def restore_of(self, request_id: str) -> StageRestore | None:
        return self._requests.restore_of(request_id)

    def _stop_released(self, request_id: str) -> None:
        self.cancel_restore(request_id, RestoreCancelledError(f"request {request_id!r} was released"))

    def queue_forward(self, item: ForwardItem) -> None:
        with self._cond:
            self._forwards.append(item)
            self._cond.notify_all()

    def shut_down(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    @property
    def has_stopped(self) -> bool:
        return self._stopped

    def wake_loop(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # -- the compute loop ---------------------------------------------------------------------------
    def next_step(self, budget: StepBudget, *, wait: bool, until: Callable[[], bool], bounded: bool = False
                  ) -> StepPlan | None:
        """The next step's work (`step_plan.decide_step`); None when there is none (after waiting for work,
        if `wait`, unless `until()` holds: checked under the lock, where restores are answered; at most
        `IDLE_WAIT_S` if `bounded`)."""
        with self._cond:
            plan = decide_step(self._forwards, self._scheduler, budget, now=time.perf_counter(),
                               ready=self._computable, mode_of=lambda request_id: self._restore(request_id).spec.mode)
            if plan.empty:
                if wait and not until():
                    self._idle_wait(bounded=bounded)
                return None
            return plan

    def end_step(self, plan: StepPlan, forward_out: list[torch.Tensor], computed: list[UnitComputed],
                 failed: dict[str, BaseException], started: float, ended: float) -> list[ForwardItem]:
        """Report a step that ran: its time, every unit computed, the requests that failed; record each
        forward slice's rows. Returns the forward items now complete (out of the queue)."""
        with self._cond:
            self._scheduler.step_done(STAGE, ended - started)
            for task, out in computed:
                restore = self._requests.restore_of(task.request_id)
                if restore is None or task.request_id in failed:
                    continue
                restore.computed(task.unit, out, started, ended)
                self._scheduler.computed(STAGE, task.request_id, task.unit)
            for request_id, error in failed.items():
                self._fail(request_id, error)
            finished = self._advance_forwards(plan, forward_out)
            self._settle()
            self._cond.notify_all()
        return finished

    def fail_step(self, plan: StepPlan, error: BaseException) -> None:
        """The step's batched forward failed: everything in it fails."""
        with self._cond:
            for task in (*plan.token_units, *plan.layer_units):
                self._fail(task.request_id, error)
            for item, _, _ in plan.forwards:
                if item in self._forwards:
                    self._forwards.remove(item)
                if not item.future.done():
                    item.future.set_exception(error)
            self._cond.notify_all()

    # -- the channels -------------------------------------------------------------------------------
    def wait_for_load(self, channel: int) -> tuple[LoadTask, StageRestore] | None:
        """Wait for the scheduler to give `channel` a load; None once the engine stops."""
        with self._cond:
            while not self._stopped:
                task = self._scheduler.next_load(channel, time.perf_counter())
                self._looked(channel, loading=task is not None)
                if task is not None:
                    return task, self._restore(task.request_id)
                self._idle_wait()
        return None

    def report_load(self, channel: int, task: LoadTask, miss: str, ended: float) -> None:
        with self._cond:
            if miss:
                self._scheduler.load_missed(STAGE, task.request_id, task.unit, miss)
            else:
                self._scheduler.loaded(STAGE, task.request_id, task.unit, ended)
            self._channel_loading[channel] = False
            self._settle()
            self._cond.notify_all()

    # -- under the lock -----------------------------------------------------------------------------
    def _idle_wait(self, *, bounded: bool = False) -> None:
        """Wait for the next event: with restores in flight (or `bounded`: a caller that waits for something
        the engine is not told of) at most `IDLE_WAIT_S`, as the scheduler's decisions depend on the time;
        with none, until something happens (an arrival, a forward, a stop: each notifies), so an idle
        engine takes no CPU."""
        self._cond.wait(timeout=IDLE_WAIT_S if bounded or self._requests.restores() else None)

    def _looked(self, channel: int, *, loading: bool) -> None:
        """A channel asked the scheduler for work."""
        self._channel_looks[channel] += 1
        self._channel_loading[channel] = loading
        if any(not r.seen_by_channels for r in self._requests.restores()):
            self._cond.notify_all()  # the compute loop may be waiting for this look

    def _computable(self, request_id: str, unit: int) -> bool:
        """Compute may take `unit` now: its input is here and the channels have looked at its request."""
        restore = self._restore(request_id)
        return self._seen_by_channels(restore) and restore.ready(unit)

    def _restore(self, request_id: str) -> StageRestore:
        """The restore of a request the scheduler is restoring (it has one)."""
        restore = self._requests.restore_of(request_id)
        assert restore is not None, f"the scheduler restores {request_id!r}, which has no restore"
        return restore

    def _seen_by_channels(self, restore: StageRestore) -> bool:
        """Whether every channel has looked since `restore` arrived, or is busy loading; a restore that
        loads nothing needs no look."""
        if not restore.seen_by_channels:
            looks = zip(self._channel_looks, restore.looks_at_admit, self._channel_loading, strict=True)
            restore.seen_by_channels = not restore.spec.policy.loads or all(
                now > then or loading for now, then, loading in looks)
        return restore.seen_by_channels

    def _advance_forwards(self, plan: StepPlan, outputs: list[torch.Tensor]) -> list[ForwardItem]:
        """Record each slice's rows [t, hidden]; the items now complete leave the queue."""
        finished = []
        for (item, _, b), out in zip(plan.forwards, outputs, strict=True):
            item.outputs.append(out)
            item.done_rows = b
            if item.left == 0:
                self._forwards.remove(item)
                finished.append(item)
        return finished

    def _fail(self, request_id: str, error: BaseException) -> None:
        """Stop a restore with `error`."""
        restore = self._requests.restore_of(request_id)
        if self._scheduler.cancel(request_id, str(error)) and restore is not None:
            restore.error = error
        self._settle()

    def _settle(self) -> None:
        """Answer every restore that finished or failed."""
        for request_id in self._scheduler.finished():
            self._scheduler.forget(request_id)
            restore = self._requests.end_restore(request_id)
            if restore is not None:
                restore.close()
                restore.done.set_result(restore.summary(self._stage))
        for request_id, reason in self._scheduler.failed().items():
            self._scheduler.forget(request_id)
            restore = self._requests.end_restore(request_id)
            if restore is not None:
                restore.close()
                restore.done.set_exception(restore.error or CacheFlowError(reason))
