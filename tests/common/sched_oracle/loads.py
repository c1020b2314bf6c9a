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
    """Every load a channel is serving, in the order they started."""

    def __init__(self) -> None:
        self._loads: dict[LoadTask, InFlightLoad] = {}

    def start(self, task: LoadTask, load: InFlightLoad) -> None:
        self._loads[task] = load

    def end(self, task: LoadTask) -> InFlightLoad | None:
        """Stop tracking `task`; None if it was not tracked (a stale report)."""
        return self._loads.pop(task, None)

    def drop_channel(self, channel: int) -> None:
        """Forget the loads on a lost channel: their reports become stale."""
        self._loads = {task: load for task, load in self._loads.items() if load.channel != channel}

    def drop_request(self, request_id: str) -> None:
        """Forget the loads of a request that failed: their reports become stale."""
        self._loads = {task: load for task, load in self._loads.items() if task.request_id != request_id}

    def busy_on(self, channels: set[int]) -> dict[int, InFlightLoad]:
        """The load in flight on each of `channels` that has one (the latest started, if several)."""
        return {load.channel: load for load in self._loads.values() if load.channel in channels}
