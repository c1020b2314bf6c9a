"""The loads in flight, keyed by task: a landing or missed load is matched to its claim here, and a
report about a load that is no longer tracked (its channel or request was lost) is recognised as stale.
"""

from __future__ import annotations

from typing import NamedTuple

from cacheflow_common.sched.tasks import LoadTask


class InFlightLoad(NamedTuple):
    """A load a channel is serving: where, since when, and what it was predicted to take then."""

    channel: int
    started_s: float
    predicted_s: float  # calibrated prediction when it started


class LoadsInFlight:
    """Every load a channel is serving, in the order they started, also by channel."""

    def __init__(self) -> None:
        self._loads: dict[LoadTask, InFlightLoad] = {}
        self._on: dict[int, dict[LoadTask, InFlightLoad]] = {}  # channel -> its loads, in the order they started

    def start(self, task: LoadTask, load: InFlightLoad) -> None:
        self._loads[task] = load
        self._on.setdefault(load.channel, {})[task] = load

    def end(self, task: LoadTask) -> InFlightLoad | None:
        """Stop tracking `task`; None if it was not tracked (a stale report)."""
        load = self._loads.pop(task, None)
        if load is not None:
            del self._on[load.channel][task]
        return load

    def drop_channel(self, channel: int) -> None:
        """Forget the loads on a lost channel: their reports become stale."""
        for task in self._on.pop(channel, {}):
            del self._loads[task]

    def drop_request(self, request_id: str) -> None:
        """Forget the loads of a request that failed: their reports become stale."""
        for task in [task for task in self._loads if task.request_id == request_id]:
            self.end(task)

    def latest_on(self, channel: int) -> InFlightLoad | None:
        """The load in flight on `channel` (the latest started, if several); None if it has none."""
        loads = self._on.get(channel)
        return next(reversed(loads.values())) if loads else None

    def busy_on(self, channels: set[int]) -> dict[int, InFlightLoad]:
        """The load in flight on each of `channels` that has one (the latest started, if several)."""
        return {channel: load for channel in channels if (load := self.latest_on(channel)) is not None}
