"""What a restore is asked to do (`RestoreJob`) and what it did (`RestoreResult`, a `UnitRecord` per unit, from a
`UnitLog` and the units' two-pointer states).

Plain data shared by the engine (`cacheflow_common.engine`), the savers, the boundary inputs and the
benchmarks' fixed-split baseline runner (`restore.executor`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from cacheflow_common.errors import BadRequestError
from cacheflow_common.kv.keys import ChunkKey, HeadRange
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.restore.pointers import Unit

__all__ = ["ChunkComputed", "RestoreJob", "RestoreResult", "UnitLog", "UnitRecord"]

# Told of each chunk the compute side finished (token mode): its index and the hidden state leaving
# the stage for it, [T, hidden] (the next stage's input in a pipelined restore).
ChunkComputed = Callable[[int, torch.Tensor], None]


@dataclass(frozen=True, kw_only=True)
class RestoreJob:
    """One request's cached prefix on one stage: what to restore, and how it was stored."""

    token_ids: tuple[int, ...]
    keys: tuple[ChunkKey, ...]  # one per chunk of token_ids (the last may be partial)
    layers: range  # the stage's layers [a_s, b_s)
    kv_dtype: str  # dtype the chunks were stored in, e.g. "bfloat16"
    quant: str = "none"  # "none" | "int8"
    heads: HeadRange | None = None  # the model's KV heads restored (a tensor-parallel rank's); None: all of them

    def __post_init__(self) -> None:
        covered = self.keys[-1].token_end if self.keys else 0
        if covered != len(self.token_ids):
            raise BadRequestError(f"chunk keys cover {covered} tokens but the prefix has {len(self.token_ids)}")

    @property
    def chunk_size(self) -> int:
        """The tokens per stored chunk (the first chunk's length; 1 for an empty prefix)."""
        return self.keys[0].token_end - self.keys[0].token_start if self.keys else 1


@dataclass
class UnitRecord:
    """How one unit was restored: by which side, when (seconds since the restore started), why it missed."""

    source: str = ""  # "computed" | "loaded"
    start_s: float = 0.0
    end_s: float = 0.0
    miss_reason: str = ""


class UnitLog:
    """What happened to each unit of one restore besides its state: when its claim started and ended (seconds
    since the log began) and why its load missed. Which side restored a unit is its two-pointer state, kept
    once, by whoever runs the pointers (the batch scheduler, or the baselines' board); `records` joins the two."""

    def __init__(self, n: int) -> None:
        self.t0 = time.perf_counter()
        self._starts = [0.0] * n
        self._ends = [0.0] * n
        self._misses: dict[int, str] = {}  # unit -> why its load missed (it is computed instead)

    def started(self, unit: int, at: float) -> None:
        self._starts[unit] = at - self.t0

    def ended(self, unit: int, at: float) -> None:
        self._ends[unit] = at - self.t0

    def missed(self, unit: int, reason: str) -> None:
        self._misses[unit] = reason

    def missed_units(self) -> list[int]:
        return sorted(self._misses)

    def misses(self) -> Counter[str]:
        """How many loads missed, by reason."""
        return Counter(self._misses.values())

    def records(self, states: Sequence[Unit]) -> list[UnitRecord]:
        """Every unit's record; `states` are the units' two-pointer states (LOADED or COMPUTED once restored)."""
        return [UnitRecord(source=_SOURCES.get(state, ""), start_s=self._starts[u], end_s=self._ends[u],
                           miss_reason=self._misses.get(u, "")) for u, state in enumerate(states)]


_SOURCES = {Unit.LOADED: "loaded", Unit.COMPUTED: "computed"}


@dataclass
class RestoreResult:
    """What a restore did: the filled KV buffer and, per unit, which side restored it and when."""

    policy: str
    mode: str  # "token" | "layer"
    kv: KVBuffer
    units: list[UnitRecord]
    elapsed_s: float
    loader_error: str = ""  # an unexpected loader failure (its units were recomputed)
    bytes_loaded: int = 0
    boundary_bytes_read: int = 0  # a later pipeline stage's: the boundary activations it read
    misses: Counter[str] = field(default_factory=Counter)
    fallback: str = ""  # why the policy or mode differs from the one asked for ("" when it does not)

    def sources(self) -> list[str]:
        return [u.source for u in self.units]
