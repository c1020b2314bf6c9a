"""What a restore is asked to do (`RestoreJob`) and what it did (`RestoreResult`, a `UnitRecord` per unit).

Plain data shared by the engine (`cacheflow_common.engine`), the savers, the boundary inputs and the
benchmarks' fixed-split baseline runner (`restore.executor`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cacheflow_common.errors import BadRequestError
from cacheflow_common.kv.keys import ChunkKey
from cacheflow_common.model.kv_buffer import KVBuffer

__all__ = ["ChunkComputed", "RestoreJob", "RestoreResult", "UnitRecord"]

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
    misses: Counter[str] = field(default_factory=Counter)
    fallback: str = ""  # why the policy or mode differs from the one asked for ("" when it does not)

    def sources(self) -> list[str]:
        return [u.source for u in self.units]
