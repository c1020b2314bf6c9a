"""Exact arithmetic on predicted seconds, so the scheduler's aggregates never drift and its comparisons
never depend on the order a sum was taken in.

A float is an integer number of 2**-1074 seconds (the smallest subnormal), so a sum kept as that integer
is exact: adding and removing units in any order gives the same total as summing the units left from
scratch. A product with a float factor (`ratio`) stays an integer, in units 2**shift times finer.
"""

from __future__ import annotations

from functools import lru_cache

EXACT_ONE = 1 << 1074  # one second, in the unit every float is a whole multiple of


@lru_cache(maxsize=4096)  # a batch's units mostly share a few costs; a decision, a few clock readings
def exact(seconds: float) -> int:
    """`seconds` as an integer number of 2**-1074 s, exactly."""
    numerator, denominator = seconds.as_integer_ratio()  # the denominator is a power of two, at most 2**1074
    return numerator * (EXACT_ONE // denominator)


@lru_cache(maxsize=64)  # the load calibration's scale, asked at every meeting point
def ratio(x: float) -> tuple[int, int]:
    """(numerator, shift) with `x == numerator / 2**shift`, exactly."""
    numerator, denominator = x.as_integer_ratio()
    return numerator, denominator.bit_length() - 1

