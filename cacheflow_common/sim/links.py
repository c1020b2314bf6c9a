"""Storage pods' links in the simulator, shared by the loads in flight on each (processor sharing).

A storage pod shapes everything it sends with one token bucket, in small slices booked in arrival
order, so `n` readers at once each get about 1/n of its rate. A load is `seconds` of its pod's link at
the full rate; with `n` loads in flight each progresses at 1/n. One reader per pod (the simulator's
cluster-wide channels) is the exclusive link it always was.
"""

from __future__ import annotations


class SharedLink:
    """One pod's link: the loads in flight and the work each still needs at the full rate."""

    def __init__(self) -> None:
        self._left: dict[int, float] = {}  # load -> seconds of work left at the full rate
        self._at = 0.0  # when `_left` was last brought up to date
        self.busy_s = 0.0  # time with at least one load in flight
        self.version = 0  # bumped at every change: a completion planned before it is stale

    def start(self, load: int, seconds: float, now: float) -> None:
        self._advance(now)
        self._left[load] = seconds
        self.version += 1

    def finish(self, load: int, now: float) -> None:
        self._advance(now)
        del self._left[load]
        self.version += 1

    def next_completion(self, now: float) -> tuple[float, int] | None:
        """When the next load finishes if nothing else changes, and which; None when idle."""
        if not self._left:
            return None
        load = min(self._left, key=self._left.__getitem__)
        return now + self._left[load] * len(self._left), load

    def _advance(self, now: float) -> None:
        if self._left and now > self._at:
            share = (now - self._at) / len(self._left)
            self._left = {load: max(0.0, left - share) for load, left in self._left.items()}
            self.busy_s += now - self._at
        self._at = now
