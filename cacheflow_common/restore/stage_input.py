"""Where a stage's compute side takes its input from: the hidden states entering the stage's first layer.

Stage 0 computes from the token embeddings (`EmbeddingInput`); a stage s > 0 from its stored boundary
activations (`boundary.BoundaryInput`) or from the previous stage's output (`upstream.UpstreamInput`).
The engine and the benchmarks' fixed-split runner take any of them as a `StageInput`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from cacheflow_common.model.transformer import Transformer


class StageInput(Protocol):
    """The hidden states entering the stage for prefix tokens [start, end): [T, hidden]."""

    def __call__(self, start: int, end: int) -> torch.Tensor: ...

    def ready(self, start: int, end: int) -> bool: ...  # in memory now (and if not, on its way)


class EmbeddingInput:
    """Stage 0's input: the token embeddings (always ready)."""

    def __init__(self, model: Transformer, token_ids: tuple[int, ...]) -> None:
        self.model = model
        self.ids = torch.tensor(token_ids, dtype=torch.long)  # [N]

    def __call__(self, start: int, end: int) -> torch.Tensor:
        return self.model.embed(self.ids[start:end])  # [T, hidden]

    def ready(self, start: int, end: int) -> bool:
        return True
