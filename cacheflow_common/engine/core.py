"""What a stage engine's compute loop, its channel loaders and its request threads share, under one lock.

* `scheduler` — the batch scheduler (the same object the simulator drives) for this stage: stage 0 of
  a one-stage scheduler, since every worker schedules its own stage; its channels are the pods.
* `restores` — the requests restoring here, by id; `forwards` — forward work waiting for the loop
  (suffix-prefill chunks and decode tokens), in arrival order.
* `settle` hands every restore the scheduler finished or failed its answer.
* Channels look first: a new restore that loads computes nothing until every channel has asked the
  scheduler for work since it arrived (or is busy loading). Without this, the compute loop, already
  awake, would take units before an idle channel's thread is scheduled, and the meeting point would
  see no load in flight: a head start for compute that the scheduler (and the simulator) never meant.

Every change that could give a waiting thread work notifies `cond` (`wake`).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.errors import CacheFlowError
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.sched.policies import Policy
from cacheflow_common.sched.scheduler import BatchScheduler

STAGE = 0  # this worker's stage, as its own one-stage scheduler numbers it


class RestoreCancelledError(CacheFlowError):
    """The request was released (its client went away) while it restored."""


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


IDLE_WAIT_S = 0.05  # with restores in flight, a loop or channel with nothing to do re-checks this often


class EngineCore:
    def __init__(self, policy: Policy, *, stage: int, n_channels: int) -> None:
        self.stage = stage  # the pipeline stage, for answers and errors
        self.channel_looks = [0] * n_channels  # how often each channel has asked the scheduler for work
        self.channel_loading = [False] * n_channels  # each channel: a load in flight
        self.cond = threading.Condition()
        self.scheduler = BatchScheduler(policy, n_stages=1)
        self.restores: dict[str, StageRestore] = {}
        self.forwards: deque[ForwardItem] = deque()
        self.stopped = False
        self._errors: dict[str, BaseException] = {}  # request -> why it failed (set with `fail`)

    def idle_wait(self) -> None:
        """Wait (holding `cond`) for the next event: with restores in flight at most `IDLE_WAIT_S`, as the
        scheduler's decisions depend on the time; with none, until something happens (an arrival, a
        forward, a stop: each notifies), so an idle engine takes no CPU."""
        self.cond.wait(timeout=IDLE_WAIT_S if self.restores else None)

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def admit(self, restore: StageRestore) -> None:
        with self.cond:
            self.restores[restore.request_id] = restore
            restore.looks_at_admit = tuple(self.channel_looks)
            self.scheduler.arrive(restore.plan, restore.spec.policy)
            self.settle()  # an empty prefix is done on arrival
            self.cond.notify_all()

    def looked(self, channel: int, *, loading: bool) -> None:
        """A channel asked the scheduler for work (the caller holds `cond`)."""
        self.channel_looks[channel] += 1
        self.channel_loading[channel] = loading
        if any(not r.seen_by_channels for r in self.restores.values()):
            self.cond.notify_all()  # the compute loop may be waiting for this look

    def seen_by_channels(self, restore: StageRestore) -> bool:
        """Whether every channel has looked since `restore` arrived, or is busy loading (the caller holds
        `cond`); a restore that loads nothing needs no look."""
        if not restore.seen_by_channels:
            looks = zip(self.channel_looks, restore.looks_at_admit, self.channel_loading, strict=True)
            restore.seen_by_channels = not restore.spec.policy.loads or all(
                now > then or loading for now, then, loading in looks)
        return restore.seen_by_channels

    def fail(self, request_id: str, error: BaseException) -> None:
        """Stop a restore with `error` (the caller holds `cond`)."""
        if self.scheduler.cancel(request_id, str(error)):
            self._errors[request_id] = error
        self.settle()

    def settle(self) -> None:
        """Answer every restore that finished or failed (the caller holds `cond`)."""
        for request_id in self.scheduler.finished():
            self.scheduler.forget(request_id)
            restore = self.restores.pop(request_id, None)
            if restore is not None:
                restore.close()
                restore.done.set_result(restore.summary(self.stage))
        for request_id, reason in self.scheduler.failed().items():
            self.scheduler.forget(request_id)
            restore = self.restores.pop(request_id, None)
            error = self._errors.pop(request_id, None) or CacheFlowError(reason)
            if restore is not None:
                restore.close()
                restore.done.set_exception(error)
