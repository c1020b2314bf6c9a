"""The scheduler's records of its batch: which requests are being restored (also in the orders the
decisions walk them: `index`), which finished (in order) and which failed (and why), and the loads in
flight; and what the caller reads of them.

A base of `BatchScheduler`, so callers read these from the scheduler itself.
"""

from __future__ import annotations

from cacheflow_common.restore.pointers import InvalidTransitionError, Unit
from cacheflow_common.sched.index import BatchIndex
from cacheflow_common.sched.loads import LoadsInFlight
from cacheflow_common.sched.work import RequestWork


class RequestRecords:
    """Every request the scheduler has seen, by outcome, and the loads it is waiting for."""

    def __init__(self) -> None:
        self._active: dict[str, RequestWork] = {}  # in arrival order
        self._index = BatchIndex()  # the active requests again, in the orders decisions walk them
        self._loads = LoadsInFlight()
        self._finished: dict[str, None] = {}  # in the order they finished
        self._failed: dict[str, str] = {}  # request -> why

    def finished(self) -> list[str]:
        """Requests whose pointers met on every stage, in the order they finished."""
        return list(self._finished)

    def failed(self) -> dict[str, str]:
        """Requests that cannot finish, and why."""
        return dict(self._failed)

    def is_finished(self, request_id: str) -> bool:
        return request_id in self._finished

    def active(self) -> list[str]:
        return list(self._active)

    def remaining_s(self, request_id: str) -> float:
        return self._active[request_id].remaining_s

    def unit_states(self, request_id: str, stage: int) -> list[Unit]:
        return list(self._active[request_id].stages[stage].pointers.states)

    def forget(self, request_id: str) -> None:
        """Drop a finished or failed request's record (a long-running worker would keep them all)."""
        self._finished.pop(request_id, None)
        self._failed.pop(request_id, None)

    def _request(self, request_id: str) -> RequestWork | None:
        """The active request; None if it failed (its events are stale); an error if it never arrived."""
        request = self._active.get(request_id)
        if request is None and request_id not in self._failed:
            raise InvalidTransitionError(f"request {request_id} is not being restored")
        return request

    def _finish_if_complete(self, request: RequestWork) -> None:
        if request.complete():
            del self._active[request.request_id]
            self._index.remove(request)
            self._finished[request.request_id] = None

    def _fail(self, request: RequestWork, reason: str) -> None:
        del self._active[request.request_id]
        self._index.remove(request)
        self._failed[request.request_id] = reason
        self._loads.drop_request(request.request_id)
