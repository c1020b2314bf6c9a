"""The batch-level meeting point: may compute take a unit that storage could still deliver?

The one meeting point rule of the scheduler (described in `scheduler.py`), decided against the whole
batch rather than the request alone because the stage's compute loop and the storage channels are
shared: the pending units are split where the restore would end first, given the measured step time
and every load the channels would serve before this request's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from cacheflow_common.restore.costs import earliest_split_computes
from cacheflow_common.sched.calibration import Calibration
from cacheflow_common.sched.exact import exact, ratio
from cacheflow_common.sched.index import BatchIndex
from cacheflow_common.sched.loads import InFlightLoad, LoadsInFlight
from cacheflow_common.sched.rank_order import Rank
from cacheflow_common.sched.ranking import ChannelRanking
from cacheflow_common.sched.work import RequestWork


class BatchMeetingPoint:
    """Where compute and storage should meet on a request's stage, given everything else in the batch."""

    def __init__(self, requests: Mapping[str, RequestWork], loads: LoadsInFlight, calibration: Calibration,
                 ranking: ChannelRanking, index: BatchIndex) -> None:
        self._requests = requests  # the active batch (a live view, in arrival order)
        self._loads = loads
        self._calibration = calibration
        self._ranking = ranking
        self._index = index

    def compute_takes(self, request: RequestWork, stage: int, unit: int, now: float) -> bool:
        """May compute take `unit`, which storage could still deliver?

        The pending units are split where the restore ends first: compute takes the k lowest, one per
        step, while each channel holding any of them first loads what it serves before this request (its
        load in flight, then every request it ranks higher), then this request's units from the top
        down to the k-th. Compute takes `unit` (the lowest) if some k >= 1 ends sooner than k = 0; where
        several splits end at once, the lowest wins. A unit between the pointers that is already taken,
        restored or missed can only be computed after the ones below it: then the split cannot fall at 0.

        Seconds are added and compared exactly (`exact`), so a tie is a tie whatever the batch's order.
        """
        policy = request.policy
        if not policy.computes_pending:
            return False
        if not policy.plans_meeting:
            return True  # Cake: the pointers meet wherever they meet
        work = request.stages[stage]
        span = work.whole_pending_span()  # the units between the pointers, `unit` first, if all are PENDING
        if span is None:
            return True
        channels = work.pending_channels()
        busy = {c: load for c in channels if (load := self._loads.latest_on(c)) is not None}
        if not busy:
            return True  # no load is in flight on its channels: no event is sure to come, compute goes on
        scale, shift = ratio(self._calibration.load_scale)  # seconds below are exact, times 2**shift
        step = exact(self._calibration.step_s(stage) or work.plan.compute_s[unit]) << shift
        rank = None if policy.ranks_units else policy.load_rank(request, now)
        clock = exact(now)
        ahead = [(c, self._ahead_on(c, request, rank, busy.get(c), clock, now, scale, shift)) for c in channels]
        start, end = span.start, span.stop

        def loaded_by(k: int) -> int:
            """When every channel is done loading the pending units from the k-th on."""
            return max(work.load_between(c, start + k, end) * scale + before for c, before in ahead)

        return earliest_split_computes(len(span), lambda k: k * step, loaded_by)  # compute: k steps

    def _ahead_on(self, channel: int, request: RequestWork, rank: Rank | None, in_flight: InFlightLoad | None,
                  clock: int, now: float, scale: int, shift: int) -> int:
        """Exact seconds (times 2**shift) before `channel` can load for `request`: its load in flight, then
        every request it ranks higher than `rank` (the whole batch's claim on the channel, at the current
        ranking; None: a unit-ranking policy's, unit by unit); predicted loads count `scale / 2**shift`
        times their plan's seconds. `clock` is `now`, exact."""
        ahead = 0
        if in_flight is not None:
            ahead = max(0, exact(in_flight.started_s) + exact(in_flight.predicted_s) - clock) << shift
        load = self._units_ahead(channel, request, now) if rank is None else self._index.load_above(rank, channel)
        return ahead + load * scale

    def _units_ahead(self, channel: int, request: RequestWork, now: float) -> int:
        """Exact planned load seconds `channel` spends on other requests' units before this request's I/O
        pointer: every pending unit there that ranks above the request's best unit on the channel (units
        are taken in rank order across the batch, each request's from the top down)."""
        if not request.pending_on[channel]:
            return 0
        _, _, mine = self._ranking.choice(request, channel, now)
        ahead = 0
        for other in self._rivals(request, channel):
            for work in other.stages:
                for u in work.pending_on_channel(channel):
                    load_s = self._calibration.load_s(work, u)
                    if other.policy.unit_rank(other, work.plan.compute_s[u], load_s, now) > mine:
                        ahead += work.exact_load(u)
        return ahead

    def _rivals(self, request: RequestWork, channel: int) -> Iterator[RequestWork]:
        """The other requests of the batch `channel` could serve instead, in arrival order."""
        return (other for other in self._requests.values() if other is not request and other.loads_from(channel))
