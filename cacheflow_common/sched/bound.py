"""A lower bound on a batch's TTFT that no schedule can beat: a linear relaxation, solved exactly (HiGHS).

The data are the unit costs the scheduler plans with (`RequestPlan`: per stage and unit, the compute
seconds and their batch-shared fixed part, the load seconds and the channel holding the unit), the
arrival times, and per request what comes after its restore (`tail_s`: the restore overhead plus its
suffix prefill through the stages alone; `prefill_s`: per stage, the stage seconds that prefill takes).

The relaxation (preemptive, divisible). Time is cut into slots at the arrivals and a uniform grid up
to `horizon_s` (plus one last slot to a time by which any schedule is done). A request's first token
falls into slot k with fraction y[i,k] (sum over k = 1); each fraction restores every unit, split
divisibly between computing and loading it (zc + zl = y per unit; units not stored are computed),
and needs:
* its restore work placed in slots after its arrival that start before t[k+1] - tail_s, and its
  suffix prefill in slots that start before t[k+1] (the work may move freely between those slots);
* capacity: per slot, a stage runs at most the slot's length of work (a unit counts its cost less
  the fixed part, which a batched step pays once), a channel at most the slot's length of loads (a
  pod's link serves its loads by processor sharing: its capacity is one second per second);
* its own chain: on each stage a request computes one unit per step, a step lasting at least the
  unit's whole cost, so its computed units take their summed cost; its loads on one channel their
  summed load time; both end at least tail_s before its first token;
* admission (with `max_batch`): it holds one of max_batch slots, at most one at a time, for at least
  its longest chain plus tail_s, between its arrival and its first token.
Its first token is at least t[k] for the fraction in slot k, and at least its arrival plus tail_s
plus the chain of its (average) split. Minimising the mean (or the largest) first-token time minus
arrival over all that is a linear program; every real schedule is one of its solutions (y one-hot),
so its optimum is a lower bound. It drops: the order of units within a request (a unit needs the
ones below it), the batch window and step token caps, the compute slowdown while loading, and unit
granularity.
What it keeps exactly: both resources per stage, the shared channels, arrivals, the split of every
unit. A grid slot's width is what the per-fraction part may lose; the chains are exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cacheflow_common.errors import ConfigError
from cacheflow_common.sched.lp import LinearProgram
from cacheflow_common.sched.plan import NOT_STORED, RequestPlan

DEFAULT_SLOTS = 40  # uniform grid slots up to the horizon (arrival times are added as boundaries)


@dataclass(frozen=True, kw_only=True)
class BoundRequest:
    plan: RequestPlan  # the restore units; plan.arrival_s is the arrival
    tail_s: float = 0.0  # at least this long from restore done to first token (overhead + suffix alone)
    prefill_s: tuple[float, ...] = ()  # per stage: stage seconds its suffix prefill takes (batched: no fixed part)


@dataclass(frozen=True)
class BatchBound:
    mean_ttft_s: float  # no schedule has a lower mean TTFT (first token minus arrival)
    max_ttft_s: float  # ... nor a lower slowest-request TTFT


@dataclass(frozen=True)
class _Unit:
    stage: int
    compute_s: float  # the chain's cost (a whole step)
    capacity_s: float  # the stage capacity it takes (cost less the batch-shared fixed part)
    load_s: float
    channel: int  # NOT_STORED: compute only


def batch_bound(requests: Sequence[BoundRequest], *, horizon_s: float | None = None, slots: int = DEFAULT_SLOTS,
                max_batch: int | None = None) -> BatchBound:
    """The bound for the mean and for the slowest request (two solves of one relaxation).

    `horizon_s`: where the uniform grid ends (absolute, as the arrivals); a good schedule's last first
    token makes the bound tight; default: the relaxation's own serial estimate. Any value is valid.
    `max_batch`: at most this many requests hold an admission slot at once (None: no cap).
    """
    if not requests:
        return BatchBound(0.0, 0.0)
    if slots <= 0:
        raise ConfigError(f"slots must be positive, got {slots}")
    if max_batch is not None and max_batch <= 0:
        raise ConfigError(f"max_batch must be positive, got {max_batch}")
    return BatchBound(mean_ttft_s=_mean(requests, horizon_s, slots, max_batch),
                      max_ttft_s=_max(requests, slots, max_batch))


def _units(plan: RequestPlan) -> list[_Unit]:
    return [_Unit(s, st.compute_s[u], max(0.0, st.compute_s[u] - st.fixed_s[u]), st.load_s[u], st.load_channel[u])
            for s, st in enumerate(plan.stages) for u in range(st.n_units)]


def _grid(requests: Sequence[BoundRequest], horizon_s: float | None, slots: int) -> list[float]:
    """Slot boundaries: the arrivals, a uniform grid to the horizon, and a time any schedule beats."""
    t0 = min(r.plan.arrival_s for r in requests)
    serial = sum(r.tail_s + sum(r.prefill_s) + sum(u.compute_s for u in _units(r.plan)) for r in requests)
    last = max(r.plan.arrival_s for r in requests) + 2 * serial + 1e-9  # everything one after the other
    end = min(horizon_s, last) if horizon_s is not None and horizon_s > t0 else t0 + serial
    points = {t0 + (end - t0) * j / slots for j in range(slots + 1)} | {r.plan.arrival_s for r in requests} | {last}
    return sorted(points)


_Fraction = tuple[int, list[int], list[int | None]]  # y, and per unit its computed and loaded share (zl: None)


class _Fractions:
    """The rows every request's fractions share: the stages' and channels' capacity per slot."""

    def __init__(self, t: list[float], max_batch: int | None) -> None:
        self.t = t
        self.max_batch = max_batch
        self.lp = LinearProgram()
        self.use: dict[tuple[str, int, int], list[int]] = {}  # (kind, stage or channel, slot) -> placements

    def fraction(self, r: BoundRequest, units: list[_Unit], deadline: float) -> _Fraction | None:
        """A fraction y of request `r` with its first token by `deadline`: (y, zc, zl); None if impossible."""
        lp, t, a = self.lp, self.t, r.plan.arrival_s
        room = deadline - a - r.tail_s  # its restore is done within this many seconds of its arrival
        restore = [q for q in range(len(t) - 1) if t[q + 1] > a + 1e-12 and t[q] < deadline - r.tail_s - 1e-12]
        prefill = [q for q in range(len(t) - 1) if t[q + 1] > a + 1e-12 and t[q] < deadline - 1e-12]
        if room < -1e-12 or (units and not restore) or (any(r.prefill_s) and not prefill):
            return None
        y = lp.var()
        zc = [lp.var() for _ in units]
        zl = [lp.var() if u.channel != NOT_STORED else None for u in units]
        for c, z in zip(zc, zl, strict=True):
            lp.eq([(c, 1.0), (y, -1.0)] + ([(z, 1.0)] if z is not None else []), 0.0)
        _chains(lp, units, zc, zl, y, max(room, 0.0))
        for s in sorted({u.stage for u in units} | set(range(len(r.prefill_s)))):
            self._place([(zc[j], u.capacity_s) for j, u in enumerate(units) if u.stage == s], restore, ("stage", s))
            self._place([(y, r.prefill_s[s] if s < len(r.prefill_s) else 0.0)], prefill, ("stage", s))
        for m in sorted({u.channel for u in units} - {NOT_STORED}):
            self._place([(z, u.load_s) for z, u in zip(zl, units, strict=True) if z is not None and u.channel == m],
                        restore, ("link", m))
        if self.max_batch is not None:
            self._hold(r, units, y, zc, zl, prefill)
        return y, zc, zl

    def _hold(self, r: BoundRequest, units: list[_Unit], y: int, zc: list[int], zl: list[int | None],
              slots: list[int]) -> None:
        """Admission: a request holds one of `max_batch` slots from admission to first token, at least as long
        as each of its chains plus its tail, at most one slot at a time, between its arrival and deadline."""
        lp = self.lp
        hold = lp.var()
        lp.le([(y, r.tail_s), (hold, -1.0)], 0.0)
        for s in sorted({u.stage for u in units}):
            lp.le([(zc[j], u.compute_s) for j, u in enumerate(units) if u.stage == s]
                  + [(y, r.tail_s), (hold, -1.0)], 0.0)
        for m in sorted({u.channel for u in units} - {NOT_STORED}):
            lp.le([(z, u.load_s) for z, u in zip(zl, units, strict=True) if z is not None and u.channel == m]
                  + [(y, r.tail_s), (hold, -1.0)], 0.0)
        for v, q in zip(self._place([(hold, 1.0)], slots, ("admission", 0)), slots, strict=True):
            lp.le([(v, 1.0), (y, -(self.t[q + 1] - self.t[q]))], 0.0)

    def capacities(self) -> None:
        for (kind, _, q), used in self.use.items():
            per_second = self.max_batch if kind == "admission" and self.max_batch is not None else 1
            self.lp.le([(v, 1.0) for v in used], per_second * (self.t[q + 1] - self.t[q]))

    def _place(self, work: Sequence[tuple[int | None, float]], allowed: list[int],
               resource: tuple[str, int]) -> list[int]:
        """The work (sum of coefficient * variable, in seconds) is spread over the `allowed` slots of a resource;
        returns the amount per slot."""
        terms = [(v, c) for v, c in work if v is not None and c > 0]
        if not terms:
            return []
        spread = [self.lp.var() for _ in allowed]
        for v, q in zip(spread, allowed, strict=True):
            self.use.setdefault((*resource, q), []).append(v)
        self.lp.eq([(v, 1.0) for v in spread] + [(v, -c) for v, c in terms], 0.0)
        return spread


def _mean(requests: Sequence[BoundRequest], horizon_s: float | None, slots: int, max_batch: int | None) -> float:
    """Each request's first token spread over the grid's slots (fractions); minimise the mean."""
    f = _Fractions(_grid(requests, horizon_s, slots), max_batch)
    done = []
    for r in requests:
        units, a = _units(r.plan), r.plan.arrival_s
        first = f.lp.var()
        done.append(first)
        fractions = [(k, x) for k in range(len(f.t) - 1) if (x := f.fraction(r, units, f.t[k + 1])) is not None]
        f.lp.eq([(y, 1.0) for _, (y, _, _) in fractions], 1.0)
        f.lp.le([(y, f.t[k]) for k, (y, _, _) in fractions] + [(first, -1.0)], 0.0)  # >= its slot's start
        zc = [[x[1][j] for _, x in fractions] for j in range(len(units))]
        zl = [[z for _, x in fractions if (z := x[2][j]) is not None] for j in range(len(units))]
        _average_chains(f.lp, units, zc, zl, first, a + r.tail_s)
    f.capacities()
    mean_done = f.lp.minimize({v: 1.0 / len(done) for v in done})
    return mean_done - sum(r.plan.arrival_s for r in requests) / len(requests)


def _max(requests: Sequence[BoundRequest], slots: int, max_batch: int | None) -> float:
    """The least Z such that every request can have its first token by arrival + Z: bisection on Z, each
    step a feasibility problem whose slots are cut at the arrivals and deadlines (exact per resource)."""
    lo = max(r.tail_s for r in requests)
    hi = _grid(requests, None, 1)[-1] - min(r.plan.arrival_s for r in requests)
    if _feasible(requests, lo, max_batch):
        return lo
    for _ in range(max(30, slots)):
        if hi - lo <= 1e-6 * max(hi, 1e-9):
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _feasible(requests, mid, max_batch) else (mid, hi)
    return lo  # infeasible (or the least possible): a lower bound, within 1e-6 of the relaxation's optimum


def _feasible(requests: Sequence[BoundRequest], z: float, max_batch: int | None) -> bool:
    cuts = {r.plan.arrival_s for r in requests}
    cuts |= {r.plan.arrival_s + z for r in requests} | {r.plan.arrival_s + z - r.tail_s for r in requests}
    f = _Fractions(sorted(cuts), max_batch)
    for r in requests:
        x = f.fraction(r, _units(r.plan), r.plan.arrival_s + z)
        if x is None:
            return False
        f.lp.eq([(x[0], 1.0)], 1.0)
    f.capacities()
    return f.lp.feasible()


def _chains(lp: LinearProgram, units: list[_Unit], zc: list[int], zl: list[int | None], y: int, room: float) -> None:
    """One fraction's own chains fit in `room` seconds: per stage its computed units, per channel its loads."""
    for s in sorted({u.stage for u in units}):
        lp.le([(zc[j], u.compute_s) for j, u in enumerate(units) if u.stage == s] + [(y, -room)], 0.0)
    for m in sorted({u.channel for u in units} - {NOT_STORED}):
        lp.le([(z, u.load_s) for z, u in zip(zl, units, strict=True) if z is not None and u.channel == m]
              + [(y, -room)], 0.0)


def _average_chains(lp: LinearProgram, units: list[_Unit], avg_c: list[list[int]], avg_l: list[list[int]],
                    first: int, earliest: float) -> None:
    """first token >= arrival + tail + the chains of the request's split, averaged over its fractions."""
    for s in sorted({u.stage for u in units}):
        lp.le([(z, u.compute_s) for j, u in enumerate(units) if u.stage == s for z in avg_c[j]]
              + [(first, -1.0)], -earliest)
    for m in sorted({u.channel for u in units} - {NOT_STORED}):
        lp.le([(z, u.load_s) for j, u in enumerate(units) if u.channel == m for z in avg_l[j]]
              + [(first, -1.0)], -earliest)
    lp.le([(first, -1.0)], -earliest)
