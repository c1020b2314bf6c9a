"""Exact running sums of predicted seconds, so the scheduler's aggregates never drift.

A float is an integer number of 2**-1074 seconds (the smallest subnormal), so a sum kept as that integer
is exact: adding and removing units in any order gives the same total as summing the units left from
scratch, and the total becomes a float by one correctly rounded division.
"""

from __future__ import annotations

EXACT_ONE = 1 << 1074  # one second, in the unit every float is a whole multiple of


def exact(seconds: float) -> int:
    """`seconds` as an integer number of 2**-1074 s, exactly."""
    numerator, denominator = seconds.as_integer_ratio()  # the denominator is a power of two, at most 2**1074
    return numerator * (EXACT_ONE // denominator)


def seconds(total: int) -> float:
    """An exact total back in seconds (the nearest float)."""
    return total / EXACT_ONE
