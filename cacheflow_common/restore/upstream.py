"""The pipelined fallback: a stage restores from the hidden states the previous stage produces.

Without boundary activations, stage s can compute a chunk only from the hidden state the compute
pointer of stage s-1 produced for it. So stage s-1 *delivers* each chunk it computes (`deliver`, its
restore's `on_computed`) and, once its restore is done, *finishes* (`finish`): the chunks it loaded
instead carry no hidden state, and stage s must load them too. The engine lets stage s's compute side
take a chunk only once it was delivered (`StageRestore.ready`); its loaders take chunks from the back.

Stage s-1 computes a front run of chunks and loads the back, so what stage s receives is a front run
as well and its own two pointers stay contiguous. A chunk stage s fails to load (a miss) that stage
s-1 did not compute cannot be restored here: the restore fails with `BoundaryMissingError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from cacheflow_common.restore.boundary import BoundaryMissingError
from cacheflow_common.restore.job import RestoreJob


class UpstreamInput:
    """A `stage_input` fed chunk by chunk by the previous stage (thread-safe; any thread may deliver)."""

    def __init__(self, job: RestoreJob, *, timeout_s: float = 60.0) -> None:
        self.job = job
        self.timeout_s = timeout_s  # the longest wait for one chunk (the previous stage may be dead)
        self._cond = threading.Condition()
        self._hidden: dict[int, torch.Tensor] = {}  # chunk index -> [T, hidden]
        self._finished = False
        self._failure = ""
        self._wakers: list[Callable[[], None]] = []
        self._chunk_at = {k.token_start: i for i, k in enumerate(job.keys)}

    # -- the previous stage's side -------------------------------------------------------------
    def deliver(self, index: int, hidden: torch.Tensor) -> None:
        """Chunk `index`'s hidden state entering this stage, [T, hidden]."""
        key = self.job.keys[index]
        if hidden.shape[0] != key.token_end - key.token_start:
            raise ValueError(f"chunk {index} has {key.token_end - key.token_start} tokens, got {hidden.shape[0]} rows")
        self._update(lambda: self._hidden.__setitem__(index, hidden))

    def finish(self) -> None:
        """The previous stage is done: chunks not delivered by now never will be."""
        self._update(lambda: setattr(self, "_finished", True))

    def fail(self, reason: str) -> None:
        """The previous stage failed: every wait ends with an error."""
        self._update(lambda: setattr(self, "_failure", reason or "the previous stage failed"))

    def _update(self, change: Callable[[], object]) -> None:
        with self._cond:
            change()
            self._cond.notify_all()
            wakers = list(self._wakers)
        for wake in wakers:
            wake()

    # -- this stage's side ---------------------------------------------------------------------
    def on_wake(self, wake: Callable[[], None]) -> None:
        """Call `wake` after every delivery (the restore board's `wake`, so declined claims re-check)."""
        with self._cond:
            self._wakers.append(wake)

    def delivered(self, index: int) -> bool:
        with self._cond:
            return index in self._hidden

    def ready(self, start: int, end: int) -> bool:
        """Whether a call for tokens [start, end) would answer at once (its chunk is here, or never comes)."""
        index = self._chunk_at.get(start)
        with self._cond:
            return index in self._hidden or self._finished or bool(self._failure)

    def __call__(self, start: int, end: int) -> torch.Tensor:
        index = self._chunk_at.get(start)
        if index is None or self.job.keys[index].token_end != end:
            raise BoundaryMissingError(f"the pipelined input serves whole chunks, not tokens [{start}, {end})")
        with self._cond:
            ok = self._cond.wait_for(lambda: index in self._hidden or self._finished or self._failure,
                                     timeout=self.timeout_s)
            if index in self._hidden:
                return self._hidden.pop(index)  # [T, hidden]; each chunk is computed once
            if self._failure:
                raise BoundaryMissingError(f"chunk {index}: {self._failure}")
        reason = "the previous stage did not compute it" if ok else f"no input within {self.timeout_s:g} s"
        raise BoundaryMissingError(f"chunk {index} cannot be computed on this stage: {reason}")
