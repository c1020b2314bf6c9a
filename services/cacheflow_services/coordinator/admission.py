"""Admission and batching: requests wait in arrival order and are let in together, as a batch.

A batch forms `window_s` after the first waiting request arrived, or at once when enough wait to
fill the free slots, or when a request arrives alone at an idle cluster (nothing running, nothing else
waiting: it would wait out the window for nobody, and a request arriving after it joins its restores
in the stage engines anyway); at most `max_batch` requests run (restore + first token) at a time. Beyond
`max_queue` waiting requests, `enqueue` refuses (HTTP 429) instead of letting the queue grow.
`done` frees a ticket's slot or place whatever state it is in, as often as it is called, so every way
out of a request (finished, failed, timed out, cancelled) can call it. `stuck` says when no slot can
be expected to free up: every slot held longer than a bound, or requests waiting that nothing admits.
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
        self._running: set[Ticket] = set()
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
        """Batch slots held."""
        return len(self._running)

    def oldest_slot_age_s(self) -> float:
        """How long the slot held longest has been held (0 when none is)."""
        with self._cond:
            first = min((t.admitted_at for t in self._running), default=None)
        return 0.0 if first is None else time.monotonic() - first

    def stuck(self, bound_s: float) -> str:
        """Why no slot can be expected to free up ("" when one can): every slot held for more than
        `bound_s`, or requests waiting with a slot free for more than `bound_s` past their window."""
        now = time.monotonic()
        with self._cond:
            if not self._thread.is_alive() and not self._stopped:
                return "the admission thread is not running"
            if len(self._running) >= self.max_batch and all(now - t.admitted_at > bound_s for t in self._running):
                return f"all {self.max_batch} batch slots have been held for more than {bound_s:g} s"
            if self._waiting and len(self._running) < self.max_batch and \
                    now - self._waiting[0].queued_at > self.window_s + bound_s:
                return f"a request has waited {now - self._waiting[0].queued_at:.0f} s with a batch slot free"
        return ""

    def enqueue(self) -> Ticket:
        """A place in the queue; QueueFullError when `max_queue` already wait."""
        with self._cond:
            if len(self._waiting) >= self.max_queue and len(self._running) + len(self._waiting) >= self.max_batch:
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
        """The ticket's request is past its first token, failed, or withdrawn: its slot or place is free
        (again and again: only the first call frees anything)."""
        with self._cond:
            if ticket.state == "running":
                self._running.discard(ticket)
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
                free = self.max_batch - len(self._running)
                if not self._waiting or free <= 0:
                    self._cond.wait()
                    continue
                left = self.window_s - (time.monotonic() - self._waiting[0].queued_at)
                alone = not self._running and len(self._waiting) == 1  # an idle cluster: no batch to wait for
                if len(self._waiting) < free and left > 0 and not alone:
                    self._cond.wait(left)  # the window is open: more may join this batch
                    continue
                self._admit(min(free, len(self._waiting)))

    def _admit(self, n: int) -> None:
        self._batches += 1
        now = time.monotonic()
        for _ in range(n):
            ticket = self._waiting.popleft()
            ticket.batch, ticket.admitted_at, ticket.state = self._batches, now, "running"
            self._running.add(ticket)
            ticket.turn.set()
        self.on_batch(n)
