"""The batch-level meeting point: may compute take a unit that storage could still deliver?

The one meeting point rule of the scheduler (described in `scheduler.py`), decided against the whole
batch rather than the request alone because the stage's compute loop and the storage channels are
shared: the pending units are split where the restore would end first, given the measured step time
and every load the channels would serve before this request's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from cacheflow_common.restore.pointers import Unit
from cacheflow_common.sched.plan import NOT_STORED
from tests.common.sched_oracle.calibration import Calibration
from tests.common.sched_oracle.loads import InFlightLoad, LoadsInFlight
from tests.common.sched_oracle.ranking import ChannelRanking
from tests.common.sched_oracle.work import RequestWork, StageWork

NEVER = float("inf")  # a unit no channel is loading for its request: it will not arrive on its own


class BatchMeetingPoint:
    """Where compute and storage should meet on a request's stage, given everything else in the batch."""

    def __init__(self, requests: Mapping[str, RequestWork], loads: LoadsInFlight, calibration: Calibration,
                 ranking: ChannelRanking) -> None:
        self._requests = requests  # the active batch (a live view, in arrival order)
        self._loads = loads
        self._calibration = calibration
        self._ranking = ranking

    def compute_takes(self, request: RequestWork, stage: int, unit: int, now: float) -> bool:
        """May compute take `unit`, which storage could still deliver?"""
        policy = request.policy
        if not policy.computes_pending:
            return False
        if not policy.plans_meeting:
            return True  # Cake: the pointers meet wherever they meet
        work = request.stages[stage]
        pending = list(work.pointers.pending_span())  # the units between the pointers, `unit` first
        channels = {work.plan.load_channel[u] for u in pending if work.pointers.states[u] is Unit.PENDING}
        busy = self._loads.busy_on(channels)
        if not busy:
            return True  # no load is in flight on its channels: no event is sure to come, compute goes on
        step_s = self._calibration.step_s(stage) or work.plan.compute_s[unit]
        load_after, lowest = self._channel_times(request, work, pending, busy, now)
        return _best_split(load_after, lowest, len(pending), step_s) > 0

    def _channel_times(self, request: RequestWork, work: StageWork, pending: list[int],
                       busy: dict[int, InFlightLoad], now: float) -> tuple[list[list[float]], int]:
        """Per channel holding any of `pending` (lowest first): seconds until its loads of the units from
        the k-th on are done, for every k; and the lowest split every unit allows (a unit no channel holds
        stays on the compute side, and so does every unit below it).

        A channel gets to this request's units once it has loaded what is in flight on it and the pending
        units of every request it ranks higher; then it loads this request's units from the top down.
        """
        position = {u: i for i, u in enumerate(pending)}
        load_after: list[list[float]] = []
        on_channels: set[int] = set()
        for channel in {work.plan.load_channel[u] for u in pending} - {NOT_STORED}:
            mine = [0.0] * (len(pending) + 1)
            for u in work.pending_on_channel(channel):
                on_channels.add(u)
                mine[position[u]] += self._calibration.load_s(work, u)
            for k in reversed(range(len(pending))):
                mine[k] += mine[k + 1]
            ahead = self._ahead_on(channel, request, busy.get(channel), now)
            load_after.append([t + ahead for t in mine])
        lowest = 0
        for i, u in enumerate(pending):
            if u not in on_channels:
                lowest = i + 1
        return load_after, lowest

    def _ahead_on(self, channel: int, request: RequestWork, in_flight: InFlightLoad | None, now: float) -> float:
        """Seconds before `channel` can load for `request`: its load in flight, then every request it
        ranks higher (the whole batch's claim on the channel, at the current ranking)."""
        ahead = max(0.0, in_flight.started_s + in_flight.predicted_s - now) if in_flight else 0.0
        if request.policy.ranks_units:
            return ahead + self._units_ahead(channel, request, now)
        rank = request.policy.load_rank(request, now)
        for other in self._rivals(request, channel):
            if other.policy.load_rank(other, now) > rank:
                ahead += sum(self._calibration.load_s(w, u)
                             for w in other.stages for u in w.pending_on_channel(channel))
        return ahead

    def _units_ahead(self, channel: int, request: RequestWork, now: float) -> float:
        """Load seconds `channel` spends on other requests' units before this request's I/O pointer: every
        pending unit there that ranks above the request's best unit on the channel (units are taken in
        rank order across the batch, each request's from the top down)."""
        if not request.pending_on[channel]:
            return 0.0
        _, _, mine = self._ranking.choice(request, channel, now)
        ahead = 0.0
        for other in self._rivals(request, channel):
            for work in other.stages:
                for u in work.pending_on_channel(channel):
                    load_s = self._calibration.load_s(work, u)
                    if other.policy.unit_rank(other, work.plan.compute_s[u], load_s, now) > mine:
                        ahead += load_s
        return ahead

    def _rivals(self, request: RequestWork, channel: int) -> Iterator[RequestWork]:
        """The other requests of the batch `channel` could serve instead, in arrival order."""
        return (other for other in self._requests.values() if other is not request and other.loads_from(channel))


def _best_split(load_after: list[list[float]], lowest: int, n_pending: int, step_s: float) -> int:
    """How many pending units (lowest first) compute should take: the split that ends the restore first,
    compute taking one unit per `step_s` and each channel done at `load_after[channel][split]`."""
    best_k, best_t = n_pending, NEVER
    for k in range(lowest, n_pending + 1):
        t = max(k * step_s, max((channel_s[k] for channel_s in load_after), default=0.0))
        if t < best_t:
            best_k, best_t = k, t
    return best_k
