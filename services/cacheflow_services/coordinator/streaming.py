"""A streamed completion's HTTP response: server-sent events, and the completion stopped when its client leaves.

Starlette's own StreamingResponse notices a disconnect but then waits for the event being produced (a
worker thread blocked on a stage call or in the admission queue) and never closes an iterator it has
not started; a completion abandoned that way would hold its batch slot until its first token, or
forever. Here a watcher stops the completion as soon as the client goes away (its slot freed, every
stage told to drop it, the thread in a stage call released at once), and it is stopped too on every
other way out (finished, failed), which costs nothing once it is over.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import anyio
import anyio.to_thread
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

log = logging.getLogger(__name__)


class CompletionStream(StreamingResponse):
    def __init__(self, events: Iterator[str], *, stop: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events
        self._stop_completion = stop

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._watch, receive, tasks.cancel_scope)
                await self._stream(send)
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self._stop_completion)

    async def _watch(self, receive: Receive, scope: anyio.CancelScope) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        log.info("a streaming client went away: its completion is stopped")
        scope.cancel()

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        while (event := await anyio.to_thread.run_sync(_next_event, self._events, abandon_on_cancel=True)) is not None:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _next_event(events: Iterator[str]) -> str | None:
    return next(events, None)
