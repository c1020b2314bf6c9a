"""The batch-level meeting point: may compute take a unit that storage could still deliver?

The one meeting point rule of the scheduler (described in `scheduler.py`), decided against the whole
batch rather than the request alone because the stage's compute loop and the storage channels are
shared: the pending units are split where the restore would end first, given the measured step time
and every load the channels would serve before this request's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from cacheflow_common.sched.calibration import Calibration
from cacheflow_common.sched.exact import seconds
from cacheflow_common.sched.index import BatchIndex
from cacheflow_common.sched.loads import InFlightLoad, LoadsInFlight
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
        step_s = self._calibration.step_s(stage) or work.plan.compute_s[unit]
        scale = self._calibration.load_scale
        end = span.stop
        ahead = {c: self._ahead_on(c, request, busy.get(c), now) for c in channels}

        def loaded_by(k: int) -> float:
            """When every channel is done loading the pending units from the k-th on (0.0 if none holds any)."""
            return max((seconds(work.load_between(c, span.start + k, end)) * scale + ahead[c] for c in channels),
                       default=0.0)

        return _compute_takes_some(len(span), step_s, loaded_by)

    def _ahead_on(self, channel: int, request: RequestWork, in_flight: InFlightLoad | None, now: float) -> float:
        """Seconds before `channel` can load for `request`: its load in flight, then every request it
        ranks higher (the whole batch's claim on the channel, at the current ranking)."""
        ahead = max(0.0, in_flight.started_s + in_flight.predicted_s - now) if in_flight else 0.0
        if request.policy.ranks_units:
            return ahead + self._units_ahead(channel, request, now)
        rank = request.policy.load_rank(request, now)
        return ahead + seconds(self._index.load_above(rank, channel)) * self._calibration.load_scale

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


def _compute_takes_some(n_pending: int, step_s: float, loaded_by: Callable[[int], float]) -> bool:
    """Whether the split of `n_pending` units that ends the restore first gives compute at least one: with
    compute taking the k lowest, one per `step_s`, the restore ends at max(k * step_s, loaded_by(k)).

    Compute's end rises with k and the channels' end falls (costs are never negative), so some k >= 1 ends
    strictly sooner than k = 0 exactly when the largest k whose compute ends before k = 0's end does.
    """
    at_zero = max(0.0, loaded_by(0))
    k = n_pending if step_s <= 0 else min(n_pending, int(at_zero / step_s))
    while k > 0 and k * step_s >= at_zero:  # the division may round either way: settle on the exact product
        k -= 1
    while k < n_pending and (k + 1) * step_s < at_zero:
        k += 1
    return k > 0 and loaded_by(k) < at_zero
