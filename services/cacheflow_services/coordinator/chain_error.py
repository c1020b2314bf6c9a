"""How a stage's failure reaches the coordinator: one typed error, naming the stage that failed and how.

Every fallback before a request's first token is keyed on this error's fields (`unreachable`,
`boundaries_missing`), never on its message, so a reworded detail cannot change which way a request goes.
"""

from __future__ import annotations

import httpx

from cacheflow_common.errors import CacheFlowError
from cacheflow_common.restore.boundary import BoundaryMissingError
from cacheflow_common.stage_api import StageError


class ChainError(CacheFlowError):
    """Stage `stage` failed (`error`: its error type, e.g. "BoundaryMissingError") or could not be
    reached (`unreachable`), whichever stage the coordinator called; `status`: the HTTP status of the
    answer the coordinator got (0 when it got none)."""

    def __init__(self, stage: int, message: str, *, status: int = 0, error: str = "",
                 unreachable: bool = False) -> None:
        super().__init__(f"stage {stage}: {message}")
        self.stage = stage
        self.status = status
        self.error = error
        self.unreachable = unreachable

    @classmethod
    def not_reached(cls, stage: int, exc: httpx.HTTPError) -> ChainError:
        """The stage did not answer at all (down, restarting, or the connection broke)."""
        return cls(stage, f"unreachable ({type(exc).__name__}: {exc})", unreachable=True)

    @property
    def boundaries_missing(self) -> bool:
        """The stage lacks its boundary activations: it can restore pipelined instead."""
        return self.error == BoundaryMissingError.__name__


def checked(stage: int, response: httpx.Response) -> httpx.Response:
    """`response` if it is a success; else ChainError naming the stage that failed (the one called, or one
    further down that it relays: `StageError.hops`) and whether it could be reached."""
    if response.status_code >= 400:
        failed = StageError.of_response(response.status_code, response.content)
        raise ChainError(stage + failed.hops, failed.detail, status=response.status_code, error=failed.error,
                         unreachable=failed.unreachable)
    return response


def root_cause_first(error: ChainError) -> tuple[int, int]:
    """Among several stage failures, report an unreachable stage first (the others follow from it)."""
    return (0 if error.unreachable else 1, error.stage)
