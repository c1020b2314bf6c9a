"""A pod-wide budget of request bytes held in memory (read pieces, PUT bodies), across all connections.

Nothing is held for a request before it needs it: a read takes a piece buffer only once the object
is known to hold the range, and a PUT takes its body's room as the bytes arrive. A request that
cannot get room within its wait is refused (the pod is busy), rather than growing the pod's memory.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from cacheflow_common.errors import StoreError

GROWTH_STEP = 1024 * 1024  # room a growing buffer takes at a time


class BufferBudget:
    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self._held = 0
        self._free = threading.Condition()

    @property
    def held_bytes(self) -> int:
        return self._held

    def take(self, nbytes: int, wait_s: float) -> None:
        """Hold `nbytes` more, waiting up to `wait_s` for room; StoreError when none comes."""
        deadline = time.monotonic() + wait_s
        with self._free:
            while self._held + nbytes > self.limit_bytes:
                left = deadline - time.monotonic()
                if left <= 0 or nbytes > self.limit_bytes:
                    raise StoreError(f"the pod's request buffers are full ({self.limit_bytes} bytes): try again")
                self._free.wait(left)
            self._held += nbytes

    def give(self, nbytes: int) -> None:
        with self._free:
            self._held -= nbytes
            self._free.notify_all()

    @contextlib.contextmanager
    def growing(self, wait_s: float) -> Iterator[GrowingBuffer]:
        """An empty buffer that takes its room from the budget as it grows; all given back after the block."""
        buf = GrowingBuffer(self, wait_s)
        try:
            yield buf
        finally:
            self.give(buf.held)
            buf.held, buf.data = 0, bytearray()

    @contextlib.contextmanager
    def reserved(self, nbytes: int, wait_s: float) -> Iterator[None]:
        """`nbytes` counted against the budget while the block runs (the block allocates them)."""
        self.take(nbytes, wait_s)
        try:
            yield
        finally:
            self.give(nbytes)


class GrowingBuffer:
    """Bytes received so far (`data`), never more than the budget room it holds (`held`)."""

    def __init__(self, budget: BufferBudget, wait_s: float) -> None:
        self.budget = budget
        self.wait_s = wait_s
        self.data = bytearray()
        self.held = 0

    def room(self, want: int) -> int:
        """How many of `want` more bytes may be appended now; takes the next step of room when none is left."""
        if len(self.data) == self.held:
            step = min(GROWTH_STEP, want)
            self.budget.take(step, self.wait_s)
            self.held += step
        return min(want, self.held - len(self.data))

    def append(self, data: bytes) -> None:
        if len(self.data) + len(data) > self.held:
            raise ValueError("append beyond the room taken")  # a bug in the caller, not bad input
        self.data += data
