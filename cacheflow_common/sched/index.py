"""The batch in the orders the scheduler's decisions walk it, kept up to date event by event, so a decision
touches the requests it decides about and not the whole batch.

* `RankOrder` — the requests a channel ranks as a whole (every loading policy but a unit-ranking one), in
  the order of their policy's `load_rank`, with the PENDING units and their exact load seconds on every
  channel summed per block: "which request does a free channel serve" is the highest-ranked one with a
  PENDING unit there, and "how long before a channel gets to a request" sums the load of every request
  ranked above it. A sorted list in blocks of at most `2 * BLOCK` requests: a query adds one total per
  block above and looks inside one block, an update moves one request (O(n / BLOCK + BLOCK + log n)).
* `BatchIndex` — the whole batch for `BatchScheduler`: the rank order, the requests whose policy
  advances few in order of remaining recomputation (least first, then arrival), the ones whose policy
  advances every request and those that rank units, each in arrival order, and the fewest tokens a unit
  of any of them computes.

The scheduler tells the index of every request whose units changed state (`refresh`); ranks that move
with the clock alone (`response-ratio`) are refiled whenever a decision comes at another time (`sync`).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Iterator

from cacheflow_common.sched.work import RequestWork

Rank = tuple[float, ...]
BLOCK = 32  # a block splits past 2 * BLOCK requests: a query scans one block and adds the totals of the others


class _Block:
    """Consecutive requests of the rank order (ascending), and their per-channel totals."""

    def __init__(self, ranks: list[Rank], requests: list[RequestWork]) -> None:
        self.ranks = ranks
        self.requests = requests
        self.units: Counter[int] = Counter()  # channel -> PENDING units of these requests
        self.load: Counter[int] = Counter()  # channel -> their exact load seconds
        for request in requests:
            self.units.update(request.pending_on)
            self.load.update(request.pending_load)


class RankOrder:
    """Requests by `load_rank` (highest last), with their PENDING units and load per channel summed by block."""

    def __init__(self) -> None:
        self._blocks: list[_Block] = []
        self._highest: list[Rank] = []  # each block's highest rank, for finding a rank's block
        self._filed: dict[RequestWork, tuple[Rank, Counter[int], Counter[int]]] = {}  # as filed: rank, units, load

    def __len__(self) -> int:
        return len(self._filed)

    def file(self, request: RequestWork, rank: Rank) -> None:
        """(Re)file `request` at `rank`, with its PENDING units and load as they are now."""
        self.drop(request)
        self._filed[request] = (rank, Counter(request.pending_on), Counter(request.pending_load))
        if not self._blocks:
            self._blocks.append(_Block([], []))
            self._highest.append(rank)
        b = min(bisect_left(self._highest, rank), len(self._blocks) - 1)
        block = self._blocks[b]
        i = bisect_left(block.ranks, rank)
        block.ranks.insert(i, rank)
        block.requests.insert(i, request)
        block.units.update(request.pending_on)
        block.load.update(request.pending_load)
        self._highest[b] = block.ranks[-1]
        if len(block.ranks) > 2 * BLOCK:
            self._blocks[b:b + 1] = [_Block(block.ranks[:BLOCK], block.requests[:BLOCK]),
                                     _Block(block.ranks[BLOCK:], block.requests[BLOCK:])]
            self._highest[b:b + 1] = [block.ranks[BLOCK - 1], block.ranks[-1]]

    def drop(self, request: RequestWork) -> None:
        """Take `request` out, if it is filed."""
        filed = self._filed.pop(request, None)
        if filed is None:
            return
        rank, units, load = filed
        b = bisect_left(self._highest, rank)
        block = self._blocks[b]
        i = bisect_left(block.ranks, rank)
        del block.ranks[i], block.requests[i]
        block.units.subtract(units)
        block.load.subtract(load)
        if block.ranks:
            self._highest[b] = block.ranks[-1]
        else:
            del self._blocks[b], self._highest[b]

    def requests(self) -> Iterator[tuple[Rank, RequestWork]]:
        """Every filed request and the rank it is filed at, highest last."""
        for block in self._blocks:
            yield from zip(block.ranks, block.requests, strict=True)

    def load_above(self, rank: Rank, channel: int) -> int:
        """Exact load seconds of the PENDING units on `channel` of the requests filed above `rank`."""
        b = bisect_right(self._highest, rank)
        total = sum(block.load[channel] for block in self._blocks[b + 1:])
        if b < len(self._blocks):
            block = self._blocks[b]
            total += sum(r.pending_load[channel] for r in block.requests[bisect_right(block.ranks, rank):])
        return total

    def top(self, channel: int) -> RequestWork | None:
        """The highest-ranked request with a PENDING unit on `channel`."""
        for block in reversed(self._blocks):
            if block.units[channel] > 0:
                return next(r for r in reversed(block.requests) if r.pending_on[channel] > 0)
        return None


class BatchIndex:
    """The active requests in the orders `BatchScheduler` walks them (see the module's docstring)."""

    def __init__(self) -> None:
        self.ranks = RankOrder()
        self._ranked_at = 0.0  # the clock the rank order's moving ranks were computed at
        self._moving: dict[RequestWork, None] = {}  # filed requests whose rank moves with the clock
        self._fewest: list[tuple[float, int]] = []  # (remaining_s, order) of the advance-few requests, ascending
        self._few: list[RequestWork] = []  # the same requests, in that order
        self._fewest_key: dict[RequestWork, tuple[float, int]] = {}  # each one's key in _fewest
        self._few_arrived: dict[RequestWork, None] = {}  # the advance-few requests, in arrival order
        self._every: dict[RequestWork, None] = {}  # the every-request ones, in arrival order
        self.unit_ranked: dict[RequestWork, None] = {}  # the loading requests a channel ranks by unit, in arrival order
        self._unit_sizes: Counter[int] = Counter()  # each request's fewest tokens in a unit, counted
        self._smallest: int | None = None  # their least (None: to recount)

    def add(self, request: RequestWork) -> None:
        """A request arrived (after `refresh`, it is kept in every order that applies to it)."""
        policy = request.policy
        (self._few_arrived if policy.advances_few else self._every)[request] = None
        if policy.loads and policy.ranks_units:
            self.unit_ranked[request] = None
        self._unit_sizes[request.smallest_unit] += 1
        self._smallest = None
        self.refresh(request)

    def remove(self, request: RequestWork) -> None:
        """A request finished or failed."""
        if request in self._few_arrived:
            del self._few_arrived[request]
            self._unfile_fewest(request)
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
        policy = request.policy
        if policy.loads and not policy.ranks_units:
            self.ranks.file(request, policy.load_rank(request, self._ranked_at))
            if policy.rank_moves_with_time:
                self._moving[request] = None
        if policy.advances_few:
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
        unit_ranked = sum(r.pending_load[channel] for r in self.unit_ranked
                          if r.pending_on[channel] > 0 and r.policy.load_rank(r, self._ranked_at) > rank)
        return self.ranks.load_above(rank, channel) + unit_ranked

    def fewest_first(self) -> Iterator[RequestWork]:
        """The advance-few requests, least remaining recomputation first (ties: arrival order)."""
        return iter(self._few)

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
