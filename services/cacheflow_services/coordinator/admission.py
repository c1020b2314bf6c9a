"""Admission and batching: requests wait in arrival order and are let in together, as a batch.

A batch forms `window_s` after the first waiting request arrived, or at once when enough wait to
fill the free slots; at most `max_batch` requests run (restore + first token) at a time. Beyond
`max_queue` waiting requests, `enqueue` refuses (HTTP 429) instead of letting the queue grow.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cacheflow_common.errors import CacheFlowError


class QueueFullError(CacheFlowError):
    """Too many requests are waiting (HTTP 429)."""


class AdmissionTimeoutError(CacheFlowError):
    """A request waited longer than its deadline for a slot (HTTP 503)."""


@dataclass(eq=False)
class Ticket:
    queued_at: float = field(default_factory=time.monotonic)
    admitted_at: float = 0.0
    batch: int = 0  # the batch it was admitted in (0: not admitted)
    state: str = "waiting"  # waiting -> running -> done, or waiting -> done (withdrawn)
    turn: threading.Event = field(default_factory=threading.Event)  # set when it leaves "waiting"


class Admission:
    def __init__(self, *, max_batch: int, window_s: float, max_queue: int,
                 on_batch: Callable[[int], None] = lambda size: None) -> None:
        self.max_batch = max_batch
        self.window_s = window_s
        self.max_queue = max_queue
        self.on_batch = on_batch
        self._waiting: deque[Ticket] = deque()
        self._running = 0
        self._batches = 0
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._dispatch, name="admission", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return self._running

    def enqueue(self) -> Ticket:
        """A place in the queue; QueueFullError when `max_queue` already wait."""
        with self._cond:
            if len(self._waiting) >= self.max_queue and self._running + len(self._waiting) >= self.max_batch:
                raise QueueFullError(f"{len(self._waiting)} requests are waiting (the limit); retry later")
            ticket = Ticket()
            self._waiting.append(ticket)
            self._cond.notify_all()
            return ticket

    def wait(self, ticket: Ticket, timeout_s: float) -> bool:
        """Block until the ticket's batch is admitted (True) or it was withdrawn (False); on timeout
        it is withdrawn and AdmissionTimeoutError raised."""
        if not ticket.turn.wait(timeout_s):
            self.done(ticket)
            if ticket.batch == 0:
                raise AdmissionTimeoutError(f"no slot within {timeout_s:.0f} s")
        return ticket.batch > 0

    def done(self, ticket: Ticket) -> None:
        """The ticket's request is past its first token, failed, or withdrawn: its slot or place is free."""
        with self._cond:
            if ticket.state == "running":
                self._running -= 1
            elif ticket.state == "waiting":
                self._waiting.remove(ticket)
            ticket.state = "done"
            ticket.turn.set()
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)

    def _dispatch(self) -> None:
        with self._cond:
            while not self._stopped:
                free = self.max_batch - self._running
                if not self._waiting or free <= 0:
                    self._cond.wait()
                    continue
                left = self.window_s - (time.monotonic() - self._waiting[0].queued_at)
                if len(self._waiting) < free and left > 0:
                    self._cond.wait(left)  # the window is open: more may join this batch
                    continue
                self._admit(min(free, len(self._waiting)))

    def _admit(self, n: int) -> None:
        self._batches += 1
        now = time.monotonic()
        for _ in range(n):
            ticket = self._waiting.popleft()
            ticket.batch, ticket.admitted_at, ticket.state = self._batches, now, "running"
            self._running += 1
            ticket.turn.set()
        self.on_batch(n)
