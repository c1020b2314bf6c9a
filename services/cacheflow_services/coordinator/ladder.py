"""The fallback ladder: the ways a request's prefix can be restored, best first, declared as data.

A request starts on the top rung. When a rung fails with a `ChainError`, the request goes down to the
next rung that `takes` that error (the rungs in between are passed); an error no rung below takes is
the request's failure. An unreachable stage is taken by no rung: it is waited for instead (see
`first_token`), since no other way of restoring avoids a stage that is down.

    rung                                  taken after
    boundary, the prefix looked up        (the top)
    pipelined, the same prefix            boundaries_missing: a stage lacks its boundary activations
    boundary, the prefix still stored     restore_failed: a stage could not restore a chunk (e.g. a
                                          corrupt one with no boundary activations); the pods dropped
                                          it, so the prefix is looked up again, shorter
    pipelined, that shorter prefix        boundaries_missing
    nothing restored: whole prefill       restore_failed

A rung whose prefix is empty restores nothing and succeeds: the prompt is prefilled whole, as on a miss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, TypeVar, get_args

from cacheflow_common.stage_api import InputMode
from cacheflow_services.coordinator.chain_error import ChainError

T = TypeVar("T")
Prefix = Literal["looked-up", "still-stored"]  # as found at admission, or looked up again after a failure


def boundaries_missing(error: ChainError) -> bool:
    return error.boundaries_missing


def restore_failed(error: ChainError) -> bool:
    """A stage answered that it could not restore (it was reached: an unreachable one is waited for)."""
    return not error.unreachable


def top_rung(_: ChainError) -> bool:
    return False


@dataclass(frozen=True)
class Rung:
    """One way to restore a request's prefix before its first token."""

    input: InputMode | None  # how every stage restores it; None: nothing is restored (the prompt is prefilled)
    prefix: Prefix = "looked-up"
    takes: Callable[[ChainError], bool] = top_rung  # the errors of a rung above that send a request here


Ladder = tuple[Rung, ...]
BOUNDARY = Rung("boundary")
PIPELINED = Rung("pipelined", takes=boundaries_missing)
RESTORE_LADDER: Ladder = (BOUNDARY, PIPELINED)  # a held restore's, and StageChain's input="auto"
FIRST_TOKEN_LADDER: Ladder = (
    *RESTORE_LADDER,
    Rung("boundary", prefix="still-stored", takes=restore_failed),
    Rung("pipelined", prefix="still-stored", takes=boundaries_missing),
    Rung(None, takes=restore_failed),
)


def climb(ladder: Ladder, attempt: Callable[[Rung], T], *,
          fell: Callable[[Rung, Rung, ChainError], None] = lambda above, below, error: None,
          stopped: Callable[[], bool] = lambda: False) -> T:
    """`attempt` the top rung, then after each ChainError the next rung that takes it; `fell(above, below,
    error)` before each step down; the last error when no rung below takes it, or once `stopped` (a
    stopped request's failures are no reason to try again)."""
    failed: tuple[Rung, ChainError] | None = None
    for rung in ladder:
        if failed is not None:
            if stopped() or not rung.takes(failed[1]):
                continue
            fell(failed[0], rung, failed[1])
        try:
            return attempt(rung)
        except ChainError as exc:
            failed = (rung, exc)
    assert failed is not None, "an empty ladder"
    raise failed[1]


def input_mode(name: str) -> InputMode:
    """`name` as a stage input mode; ValueError naming the modes when it is none of them."""
    modes: tuple[InputMode, ...] = get_args(InputMode)
    for mode in modes:
        if mode == name:
            return mode
    raise ValueError(f"unknown input mode {name!r}; choose one of {', '.join(modes)} or auto")
