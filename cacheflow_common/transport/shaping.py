"""Bandwidth shaping: a FIFO token bucket in virtual time, to emulate 10/40/80 Gbit/s (or slower) links.

`reserve(n)` books the link for `n` bytes after everything booked before, and returns the moment
they will have arrived; readers sleep until then. Concurrent readers thus share the rate in arrival
order, and a reader can do its real read while its emulated transfer is under way.
"""

from __future__ import annotations

import math
import threading
import time

DEFAULT_BURST = 256 * 1024  # bytes that may pass at once after an idle spell, like a NIC's queue


def gbps(x: float) -> float:
    """Gbit/s -> bytes/s."""
    return x * 1e9 / 8


class TokenBucket:
    def __init__(self, rate_bytes_per_s: float, burst_bytes: int = DEFAULT_BURST) -> None:
        self.rate = rate_bytes_per_s
        self.unlimited = rate_bytes_per_s <= 0 or math.isinf(rate_bytes_per_s)
        self.burst_s = 0.0 if self.unlimited else burst_bytes / rate_bytes_per_s
        self._busy_until = 0.0  # when the link finishes what is booked so far (monotonic seconds)
        self._lock = threading.Lock()

    def reserve(self, nbytes: int, now: float | None = None) -> float:
        """Book `nbytes`; returns the monotonic time when they have passed the link."""
        now = time.monotonic() if now is None else now
        if self.unlimited:
            return now
        with self._lock:
            # After an idle spell, up to `burst` worth of time is credited (the bucket was full).
            start = max(self._busy_until, now - self.burst_s)
            self._busy_until = start + nbytes / self.rate
            return self._busy_until

    @staticmethod
    def wait(deadline: float) -> None:
        delay = deadline - time.monotonic()
        if delay > 0:
            time.sleep(delay)

    def consume(self, nbytes: int) -> None:
        self.wait(self.reserve(nbytes))
