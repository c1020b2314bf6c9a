"""Bandwidth shaping: a FIFO token bucket in virtual time, to emulate 10/40/80 Gbit/s (or slower) links.

`reserve(n)` books the link for `n` bytes after everything booked before and returns the monotonic
moment they will have arrived; the reader sleeps until then (`wait`). So concurrent readers share
the rate in the order they asked, the sum of what they book never exceeds the rate, and a reader can
do its real read between `reserve` and `wait`, overlapping it with the emulated transfer.

    start    = max(busy_until, now - burst / rate)     # an idle link credits at most one burst
    deadline = busy_until = start + nbytes / rate
"""

from __future__ import annotations

import math
import threading
import time

from cacheflow_common.errors import BadRequestError

DEFAULT_BURST = 256 * 1024  # bytes that may pass at once after an idle spell, like a NIC's queue


def gbps(x: float) -> float:
    """Gbit/s -> bytes/s."""
    return x * 1e9 / 8


class TokenBucket:
    """A link of `rate_bytes_per_s`; a rate <= 0 or infinite means unlimited (every deadline is now)."""

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int = DEFAULT_BURST) -> None:
        if math.isnan(rate_bytes_per_s) or burst_bytes < 0:
            raise BadRequestError(f"bad link: rate {rate_bytes_per_s} B/s, burst {burst_bytes} B")
        self.rate = float(rate_bytes_per_s)
        self.burst_bytes = burst_bytes
        self.unlimited = self.rate <= 0 or math.isinf(self.rate)
        self.burst_s = 0.0 if self.unlimited else burst_bytes / self.rate
        self._busy_until = -math.inf  # when the link finishes what is booked so far (monotonic seconds)
        self._lock = threading.RLock()  # book_slices reserves under it

    def reserve(self, nbytes: int, now: float | None = None) -> float:
        """Book `nbytes` behind every earlier booking; returns the monotonic time when they have passed.

        `now` (default: time.monotonic()) lets tests check the arithmetic without a clock.
        """
        if nbytes < 0:
            raise BadRequestError(f"cannot reserve {nbytes} bytes")
        now = time.monotonic() if now is None else now
        if self.unlimited:
            return now
        with self._lock:
            start = max(self._busy_until, now - self.burst_s)
            self._busy_until = start + nbytes / self.rate
            return self._busy_until

    def book_slices(self, nbytes: int, slice_bytes: int) -> list[tuple[int, int, float]]:
        """Book `nbytes` at once as consecutive slices: (offset, length, deadline) each.

        A pod books a read before it fetches and checks the object, so that work overlaps the
        object's time on the link, as a real server's storage read overlaps its network send.
        """
        if self.unlimited or nbytes <= 0:
            return [(0, nbytes, time.monotonic())]
        with self._lock:  # one booking: no other reader's slice lands between this object's slices
            now = time.monotonic()
            return [(start, n, self.reserve(n, now)) for start in range(0, nbytes, slice_bytes)
                    for n in (min(slice_bytes, nbytes - start),)]

    def release(self, deadline: float, nbytes: int) -> bool:
        """Give back a reservation that will not be used (a miss), if nothing was booked after it."""
        if self.unlimited:
            return True
        with self._lock:
            if self._busy_until != deadline:
                return False  # later readers are queued behind it: they keep their deadlines
            self._busy_until = deadline - nbytes / self.rate
            return True

    def wait(self, deadline: float) -> None:
        """Sleep until the monotonic time `deadline` (no busy-wait)."""
        while (delay := deadline - time.monotonic()) > 0:
            time.sleep(delay)

    def consume(self, nbytes: int) -> None:
        """Reserve `nbytes` and wait until they have passed."""
        self.wait(self.reserve(nbytes))
