"""What a request is checked for before it takes a place in the queue (so a refused request holds nothing)."""

from __future__ import annotations

from collections.abc import Sequence

from cacheflow_common.errors import BadRequestError
from cacheflow_common.sched.policies import POLICIES
from cacheflow_services.coordinator.cluster import ModelInfo


def check_policy(requested: str) -> str:
    """The restore policy for the workers ("": theirs). Adaptive `cacheflow` picks its mode on each
    stage, by that worker's profiled L_delta (token-wise on stages restoring from boundary activations)."""
    if requested and requested not in POLICIES:
        raise BadRequestError(f"unknown policy {requested!r}; choose one of {', '.join(POLICIES)}")
    return requested


class PromptChecks:
    """Whether the workers could serve a prompt: its tokens in the vocabulary, its length in the context."""

    def __init__(self, model: ModelInfo, max_new_tokens: int) -> None:
        self.model = model
        self.max_new_tokens = max_new_tokens

    def prompt(self, token_ids: Sequence[int], max_new_tokens: int) -> None:
        """BadRequestError with the reason when the workers could not serve this prompt."""
        if not token_ids:
            raise BadRequestError("the prompt is empty")
        if (bad := self._out_of_vocabulary(token_ids)) is not None:
            raise BadRequestError(f"token id {bad} is out of the model's vocabulary [0, {self.model.vocab_size})")
        if not 1 <= max_new_tokens <= self.max_new_tokens:
            raise BadRequestError(f"max_tokens must be 1..{self.max_new_tokens}, got {max_new_tokens}")
        if len(token_ids) + max_new_tokens > self.model.max_tokens:
            raise BadRequestError(f"prompt of {len(token_ids)} tokens + {max_new_tokens} new exceeds the model's "
                                  f"context of {self.model.max_tokens} tokens")

    def stop_ids(self, stop_ids: Sequence[int]) -> None:
        """BadRequestError naming the first stop token id outside the model's vocabulary (it could never stop)."""
        if (bad := self._out_of_vocabulary(stop_ids)) is not None:
            raise BadRequestError(f"stop_token_ids: token id {bad} is out of the model's vocabulary "
                                  f"[0, {self.model.vocab_size})")

    def _out_of_vocabulary(self, token_ids: Sequence[int]) -> int | None:
        return next((t for t in token_ids if not 0 <= t < self.model.vocab_size), None)
