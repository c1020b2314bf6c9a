"""The batch in the orders the scheduler's decisions walk it, kept up to date event by event, so a decision
touches the requests it decides about and not the whole batch:

* the channels' rank order (`rank_order.RankOrder`) of the requests a channel ranks as a whole (every
  loading policy but a unit-ranking one), by their policy's `load_rank`;
* the requests whose policy advances few, least remaining recomputation first (then arrival order), and
  the same in arrival order; the ones whose policy advances every request, and the loading ones a
  channel ranks by unit (`saving`), each in arrival order;
* the fewest tokens a unit of any of them computes.

The scheduler tells the index of every request whose units changed state (`refresh`); ranks that move
with the clock alone (`response-ratio`) are refiled whenever a decision comes at another time (`sync`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator

from cacheflow_common.sched.rank_order import Rank, RankOrder
from cacheflow_common.sched.work import RequestWork


class BatchIndex:
    """The active requests in the orders `BatchScheduler` walks them (see the module's docstring)."""

    def __init__(self) -> None:
        self.ranks = RankOrder()
        self._ranked_at = 0.0  # the clock the moving ranks were computed at
        self._moving: dict[RequestWork, None] = {}  # filed requests whose rank moves with the clock
        self._fewest: list[tuple[float, int]] = []  # (remaining_s, order) of the advance-few requests, ascending
        self._few: list[RequestWork] = []  # the same requests, in that order
        self._fewest_key: dict[RequestWork, tuple[float, int]] = {}  # each one's key in _fewest
        self._few_arrived: dict[RequestWork, None] = {}  # the advance-few requests, in arrival order
        self._every: dict[RequestWork, None] = {}  # the every-request ones, in arrival order
        self.unit_ranked: dict[RequestWork, None] = {}  # loading requests a channel ranks by unit, in arrival order
        self._unit_sizes: Counter[int] = Counter()  # each request's fewest tokens in a unit, counted
        self._smallest: int | None = None  # their least (None: to recount)
        self._kept: dict[RequestWork, tuple[bool, bool]] = {}  # request -> in the rank order, in the few's order

    def add(self, request: RequestWork) -> None:
        """A request arrived."""
        policy = request.policy
        ranked = policy.loads and not policy.ranks_units
        self._kept[request] = (ranked, policy.advances_few)
        (self._few_arrived if policy.advances_few else self._every)[request] = None
        if policy.loads and policy.ranks_units:
            self.unit_ranked[request] = None
        if ranked and policy.rank_moves_with_time:
            self._moving[request] = None
        self._unit_sizes[request.smallest_unit] += 1
        self._smallest = None
        self.refresh(request)

    def remove(self, request: RequestWork) -> None:
        """A request finished or failed."""
        if request in self._few_arrived:
            del self._few_arrived[request]
            self._unfile_fewest(request)
        del self._kept[request]
        self._every.pop(request, None)
        self.unit_ranked.pop(request, None)
        self.ranks.drop(request)
        self._moving.pop(request, None)
        self._unit_sizes[request.smallest_unit] -= 1
        if not self._unit_sizes[request.smallest_unit]:
            del self._unit_sizes[request.smallest_unit]
            self._smallest = None

    def refresh(self, request: RequestWork) -> None:
        """`request`'s units changed state: refile it where its remaining work or PENDING units count."""
        ranked, few = self._kept[request]
        if ranked:
            self.ranks.file(request, request.policy.load_rank(request, self._ranked_at))
        if few:
            self._unfile_fewest(request)
            key = self._fewest_key[request] = (request.remaining_s, request.order)
            i = bisect_left(self._fewest, key)
            self._fewest.insert(i, key)
            self._few.insert(i, request)

    def sync(self, now: float) -> None:
        """A decision at `now`: refile the ranks that move with the clock."""
        if now != self._ranked_at:
            self._ranked_at = now
            for request in self._moving:
                self.ranks.file(request, request.policy.load_rank(request, now))

    def load_above(self, rank: Rank, channel: int) -> int:
        """Exact load seconds of the PENDING units on `channel` of every loading request ranked above `rank`."""
        above = self.ranks.load_above(rank, channel)
        if self.unit_ranked:
            above += sum(r.pending_load[channel] for r in self.unit_ranked
                         if r.pending_on[channel] > 0 and r.policy.load_rank(r, self._ranked_at) > rank)
        return above

    def fewest_first(self) -> list[RequestWork]:
        """The advance-few requests, least remaining recomputation first (ties: arrival order); a live view."""
        return self._few

    def few_by_arrival(self) -> Iterator[RequestWork]:
        return iter(self._few_arrived)

    def every_by_arrival(self) -> Iterator[RequestWork]:
        return iter(self._every)

    def smallest_unit(self) -> int:
        """The fewest tokens a unit of any active request computes (0 with none)."""
        if self._smallest is None:
            self._smallest = min(self._unit_sizes, default=0)
        return self._smallest

    def _unfile_fewest(self, request: RequestWork) -> None:
        key = self._fewest_key.pop(request, None)
        if key is not None:
            i = bisect_left(self._fewest, key)
            del self._fewest[i], self._few[i]
