"""What a stage engine's compute loop, its channel loaders and its request threads share, under one lock.

* `scheduler` — the batch scheduler (the same object the simulator drives) for this stage: stage 0 of
  a one-stage scheduler, since every worker schedules its own stage; its channels are the pods.
* `restores` — the requests restoring here, by id; `forwards` — forward work waiting for the loop
  (suffix-prefill chunks and decode tokens), in arrival order.
* `settle` hands every restore the scheduler finished or failed its answer.

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


class EngineCore:
    def __init__(self, policy: Policy, *, stage: int) -> None:
        self.stage = stage  # the pipeline stage, for answers and errors
        self.cond = threading.Condition()
        self.scheduler = BatchScheduler(policy, n_stages=1)
        self.restores: dict[str, StageRestore] = {}
        self.forwards: deque[ForwardItem] = deque()
        self.stopped = False
        self._errors: dict[str, BaseException] = {}  # request -> why it failed (set with `fail`)

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def admit(self, restore: StageRestore) -> None:
        with self.cond:
            self.restores[restore.request_id] = restore
            self.scheduler.arrive(restore.plan, restore.spec.policy)
            self.settle()  # an empty prefix is done on arrival
            self.cond.notify_all()

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
