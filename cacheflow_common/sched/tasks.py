"""What the batch scheduler hands out: a unit for a stage's compute batch, or a unit for a channel to load.

They live apart from the scheduler so the bookkeeping of loads in flight (`loads.py`) can key on them
without importing the scheduler; `scheduler.py` re-exports both, where callers import them from.
"""

from __future__ import annotations

from typing import NamedTuple


class ComputeTask(NamedTuple):
    request_id: str
    unit: int


class LoadTask(NamedTuple):
    request_id: str
    stage: int
    unit: int
