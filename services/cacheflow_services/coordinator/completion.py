"""A completion's tokens as an iterator that can be stopped from any thread, at any point.

Its first `next` runs the first-token sequence (`first_token.py`: wait for a slot, restore, prefill), in
the thread that reads it, so a streamed answer has sent its headers by then and reports a failure as an
event; later ones stream the decodes. Whenever it ends after it started (finished, failed, aborted) it
`finish`es: a failure is recorded and the KV is released on every stage.

`abort` covers every case: never started, it `stop`s the request itself (out of the queue, its slot
freed); suspended between tokens, it finishes it; running in another thread (in the queue or a stage
call), it stops the request's work (the slot freed, the stages told to drop it, so the call in flight
returns at once) and that thread finishes it as soon as its call returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from cacheflow_services.coordinator.first_token import FirstToken


class Completion(Iterator[int]):
    def __init__(self, first_token: Callable[[], FirstToken | None], *, stop: Callable[[], None],
                 finish: Callable[[BaseException | None], None]) -> None:
        self._first_token = first_token  # None: the request was stopped before it
        self._decodes: Iterator[int] | None = None
        self._stop = stop  # frees the slot, releases the request on every stage, marks it cancelled
        self._finish = finish  # records a failure (if any) and releases the request on every stage
        self._step = threading.Lock()  # held by the thread producing a token
        self._aborted = threading.Event()
        self._started = False
        self._over = False

    def __next__(self) -> int:
        with self._step:
            if self._over or self._aborted.is_set():
                self._end()
                raise StopIteration
            self._started = True
            try:
                token = self._next_token()
            except BaseException as exc:
                self._over = True
                self._finish(None if isinstance(exc, StopIteration) else exc)
                raise
            if self._aborted.is_set():  # aborted while this thread was in a stage call
                self._end()
                raise StopIteration
            return token

    def _next_token(self) -> int:
        if self._decodes is None:
            first = self._first_token()
            if first is None:
                raise StopIteration
            self._decodes = first.decodes
            return first.token
        return next(self._decodes)

    def abort(self) -> None:
        """Stop now, from any thread (the client went away, or the reader is done with it); idempotent."""
        if self._over:
            return
        self._aborted.set()
        if not self._step.acquire(blocking=False):
            self._stop()  # a thread waits in the queue or on a stage: make it return; it ends the completion
            return
        try:
            if not self._started:
                self._stop()  # never ran, so it will never finish
            self._end()
        finally:
            self._step.release()

    close = abort

    def _end(self) -> None:
        if not self._over:
            self._over = True
            if self._started:
                self._finish(None)
