"""A streamed completion's HTTP response: server-sent events, and the completion stopped when its client leaves.

Starlette's own StreamingResponse notices a disconnect but then waits for the event being produced (a
worker thread blocked on a stage call or in the admission queue) and never closes an iterator it has
not started; a completion abandoned that way would hold its batch slot until its first token, or
forever. Here a watcher stops the completion as soon as the client goes away (its slot freed, every
stage told to drop it, the thread in a stage call released at once), and it is stopped too on every
other way out (finished, failed), which costs nothing once it is over.

A completion answered whole is watched the same way while it runs (`while_connected`): its client
going away stops it (its place in the queue or its slot freed, every stage told to drop it) instead of
letting it run to its end for nobody.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import anyio
import anyio.to_thread
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from cacheflow_services.coordinator.request import RequestLog

log = logging.getLogger(__name__)
T = TypeVar("T")
STOPPER_THREADS = 8


class Departure:
    """Whether a request's client went away, and what to stop when it does (at once if it already has)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gone = False
        self._stops: list[tuple[str, Callable[[], None]]] = []  # (request id, how to stop it)

    @property
    def gone(self) -> bool:
        return self._gone

    def on_leave(self, stop: Callable[[], None], request_id: str) -> None:
        with self._lock:
            if not self._gone:
                self._stops.append((request_id, stop))
                return
        _stop_for_departure(request_id, stop)

    def leave(self) -> None:
        with self._lock:
            self._gone, stops, self._stops = True, self._stops, []
        for request_id, stop in stops:
            _stop_for_departure(request_id, stop)


def _stop_for_departure(request_id: str, stop: Callable[[], None]) -> None:
    RequestLog(request_id, log).info("its client went away before its answer; stopping it")
    stop()


async def while_connected(receive: Receive, work: Callable[[Departure], T]) -> T:
    """`work(departure)` on a worker thread, its client watched meanwhile: if it goes away, what `work`
    registered with `departure.on_leave` is stopped (and whatever it registers later, at once)."""
    departure = Departure()
    result: list[T] = []
    failed: list[Exception] = []
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_watch_departure, receive, departure)
        try:
            result.append(await anyio.to_thread.run_sync(work, departure))
        except Exception as exc:  # raised as it is, not in the task group's ExceptionGroup
            failed.append(exc)
        tasks.cancel_scope.cancel()
    if failed:
        raise failed[0]
    return result[0]


async def _watch_departure(receive: Receive, departure: Departure) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(departure.leave, limiter=_stoppers())


_STOPPERS: list[anyio.CapacityLimiter] = []


def _stoppers() -> anyio.CapacityLimiter:
    """Threads of their own for stopping completions: the handlers' pool may be full of the very requests
    whose clients left, waiting to be stopped."""
    if not _STOPPERS:
        _STOPPERS.append(anyio.CapacityLimiter(STOPPER_THREADS))
    return _STOPPERS[0]


class CompletionStream(StreamingResponse):
    def __init__(self, events: Iterator[str], *, stop: Callable[[], None], request_id: str) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._stop_completion = stop
        self.request_id = request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._watch, receive, tasks.cancel_scope)
                await self._stream(send)
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._stop_completion, limiter=_stoppers())

    async def _watch(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        RequestLog(self.request_id, log).info("its streaming client went away; stopping it")
        scope.cancel()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        while (event := await anyio.to_thread.run_sync(_next_event, self._events, abandon_on_cancel=True)) is not None:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _next_event(events: Iterator[str]) -> str | None:
    return next(events, None)
