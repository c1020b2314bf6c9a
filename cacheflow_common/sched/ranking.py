"""Which request a free I/O channel serves, and which of its units: the channel side of the batch.

Kept apart from the meeting point, which asks the same question of every request ahead of one (how
long before a channel gets to it), so both rank with one rule.
"""

from __future__ import annotations

from cacheflow_common.sched.calibration import Calibration
from cacheflow_common.sched.index import BatchIndex
from cacheflow_common.sched.work import RequestWork

Rank = tuple[float, ...]


class ChannelRanking:
    """Ranks the requests (or their I/O-pointer units) a channel could load, by each request's policy."""

    def __init__(self, calibration: Calibration, index: BatchIndex) -> None:
        self._calibration = calibration
        self._index = index

    def best(self, channel: int, now: float) -> tuple[RequestWork, int, int] | None:
        """(request, stage, unit) `channel` should load next: the top-ranked request's choice; None if no
        request has a unit pending on it. The top of the rank order is its top request-ranked candidate
        (its rank is its policy's `load_rank`); a unit-ranking policy's requests rank by their best unit
        here, so each of them is asked. Two requests never rank equal: every rank ends in arrival order."""
        best: tuple[Rank, RequestWork, int, int] | None = None
        top = self._index.ranks.top(channel)
        if top is not None:
            stage, unit, rank = self.choice(top, channel, now)
            best = (rank, top, stage, unit)
        for request in self._index.unit_ranked:
            if not request.loads_from(channel):
                continue
            stage, unit, rank = self.choice(request, channel, now)
            if best is None or rank > best[0]:
                best = (rank, request, stage, unit)
        return None if best is None else best[1:]

    def choice(self, request: RequestWork, channel: int, now: float) -> tuple[int, int, Rank]:
        """(stage, unit, rank) a free `channel` would load for `request`: among its stages' I/O pointers on the
        channel, the unit saving the most compute per link-second (a unit-ranking policy) or the stage with
        the most open work; ranked by the policy."""
        tops = {s: unit for s, work in enumerate(request.stages)
                if (unit := work.highest_pending_on(channel)) is not None}
        policy = request.policy
        if policy.ranks_units:
            ranks = {s: policy.unit_rank(request, request.stages[s].plan.compute_s[u],
                                         self._calibration.load_s(request.stages[s], u), now) for s, u in tops.items()}
            stage = max(tops, key=lambda s: (ranks[s], -s))
            return stage, tops[stage], ranks[stage]
        stage = max(tops, key=lambda s: (request.stages[s].open_s, -s))
        return stage, tops[stage], policy.load_rank(request, now)
