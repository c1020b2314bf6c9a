"""Per storage channel, the requests with a PENDING unit on it in the order the channel ranks them, and
their load summed as it goes: the two questions a channel's side of the batch asks, answered without a
pass over the batch.

* which request does a free channel serve? The highest-ranked one there (`top`).
* how long before a channel gets to a request? Its load in flight, then the load of every request ranked
  above it (`load_above`: exact seconds, see `exact`).

Each channel's requests are a sorted list cut into blocks of at most `2 * BLOCK`, each block with its
total: a query adds the totals of the blocks above (one C-level sum over a list) and the loads above within
one block (another); an update touches one block (a bisect, an insert or delete in a short list).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterator

from cacheflow_common.sched.work import RequestWork

Rank = tuple[float, ...]
BLOCK = 32  # a block splits past 2 * BLOCK requests


class _Block:
    """Consecutive requests of one channel's order (ascending rank), and their loads there."""

    __slots__ = ("loads", "ranks", "requests")

    def __init__(self, ranks: list[Rank], requests: list[RequestWork], loads: list[int]) -> None:
        self.ranks = ranks
        self.requests = requests
        self.loads = loads


class ChannelOrder:
    """One channel's requests, ascending by rank, each with its exact PENDING load there."""

    def __init__(self) -> None:
        self._blocks: list[_Block] = []
        self._highest: list[Rank] = []  # each block's highest rank (to find a rank's block)
        self._totals: list[int] = []  # each block's total load

    def insert(self, rank: Rank, request: RequestWork, load: int) -> None:
        if not self._blocks:
            self._blocks.append(_Block([], [], []))
            self._highest.append(rank)
            self._totals.append(0)
        b = min(bisect_left(self._highest, rank), len(self._blocks) - 1)
        block = self._blocks[b]
        i = bisect_left(block.ranks, rank)
        block.ranks.insert(i, rank)
        block.requests.insert(i, request)
        block.loads.insert(i, load)
        self._highest[b] = block.ranks[-1]
        self._totals[b] += load
        if len(block.ranks) > 2 * BLOCK:  # split in two halves
            low = _Block(block.ranks[:BLOCK], block.requests[:BLOCK], block.loads[:BLOCK])
            high = _Block(block.ranks[BLOCK:], block.requests[BLOCK:], block.loads[BLOCK:])
            self._blocks[b : b + 1] = [low, high]
            self._highest[b : b + 1] = [low.ranks[-1], high.ranks[-1]]
            self._totals[b : b + 1] = [sum(low.loads), sum(high.loads)]

    def remove(self, rank: Rank) -> None:
        b, i = self._find(rank)
        block = self._blocks[b]
        self._totals[b] -= block.loads[i]
        del block.ranks[i], block.requests[i], block.loads[i]
        if block.ranks:
            self._highest[b] = block.ranks[-1]
        else:
            del self._blocks[b], self._highest[b], self._totals[b]

    def set_load(self, rank: Rank, load: int) -> None:
        b, i = self._find(rank)
        self._totals[b] += load - self._blocks[b].loads[i]
        self._blocks[b].loads[i] = load

    def load_above(self, rank: Rank) -> int:
        """Exact load of the requests ranked above `rank`."""
        b = bisect_right(self._highest, rank)
        if b == len(self._blocks):
            return 0
        block = self._blocks[b]
        return sum(self._totals[b + 1 :]) + sum(block.loads[bisect_right(block.ranks, rank) :])

    def top(self) -> RequestWork | None:
        """The highest-ranked request."""
        return self._blocks[-1].requests[-1] if self._blocks else None

    def entries(self) -> Iterator[tuple[Rank, RequestWork, int]]:
        """Every request with its rank and load, ascending."""
        for block in self._blocks:
            yield from zip(block.ranks, block.requests, block.loads, strict=True)

    def block_totals(self) -> list[tuple[int, int]]:
        """(the total kept, the sum of its loads) of every block: equal unless the totals drifted."""
        return [(total, sum(block.loads)) for total, block in zip(self._totals, self._blocks, strict=True)]

    def _find(self, rank: Rank) -> tuple[int, int]:
        b = bisect_left(self._highest, rank)
        return b, bisect_left(self._blocks[b].ranks, rank)


class RankOrder:
    """Every channel's order, and where each request is filed: its rank and its exact load per channel."""

    def __init__(self) -> None:
        self._orders: dict[int, ChannelOrder] = {}
        self._filed: dict[RequestWork, tuple[Rank, dict[int, int]]] = {}

    def file(self, request: RequestWork, rank: Rank) -> None:
        """(Re)file `request` at `rank` on every channel holding a PENDING unit of it, with its load there."""
        before = self._filed.get(request)
        if before is not None and before[0] == rank:  # its rank stayed: update its loads in place
            loads = before[1]
            for channel, n in request.pending_on.items():  # every channel it ever held a unit on
                filed = loads.get(channel)
                if n > 0:
                    load = request.pending_load[channel]
                    if filed is None:
                        self._order(channel).insert(rank, request, load)
                    elif filed != load:
                        self._orders[channel].set_load(rank, load)
                    loads[channel] = load
                elif filed is not None:
                    self._orders[channel].remove(rank)
                    del loads[channel]
            return
        if before is not None:
            for channel in before[1]:
                self._orders[channel].remove(before[0])
        loads = {c: request.pending_load[c] for c, n in request.pending_on.items() if n > 0}
        self._filed[request] = (rank, loads)
        for channel, load in loads.items():
            self._order(channel).insert(rank, request, load)

    def drop(self, request: RequestWork) -> None:
        """Take `request` out, if it is filed."""
        before = self._filed.pop(request, None)
        if before is not None:
            for channel in before[1]:
                self._orders[channel].remove(before[0])

    def filed(self, request: RequestWork) -> tuple[Rank, dict[int, int]] | None:
        """The rank and loads `request` is filed with (None if it is not)."""
        return self._filed.get(request)

    def load_above(self, rank: Rank, channel: int) -> int:
        order = self._orders.get(channel)
        return order.load_above(rank) if order is not None else 0

    def top(self, channel: int) -> RequestWork | None:
        order = self._orders.get(channel)
        return order.top() if order is not None else None

    def orders(self) -> dict[int, ChannelOrder]:
        return self._orders

    def _order(self, channel: int) -> ChannelOrder:
        return self._orders.setdefault(channel, ChannelOrder())
