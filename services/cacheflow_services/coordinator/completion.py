"""A completion's tokens as an iterator that can be stopped from any thread, at any point.

The tokens come from a generator that waits for a batch slot, restores, prefills and decodes; its
own cleanup (in `finally`) frees the slot and releases the KV on every stage. That cleanup runs only
if the generator runs: one never started (its client went away before the first token was asked
for) would hold its place in the queue, then a batch slot, forever. `Completion.abort` covers every
case: never started, it frees the slot itself; suspended between tokens, it closes the generator
(whose cleanup runs); running in another thread (in the queue or a stage call), it stops the
request's work (the slot freed, the stages told to drop it, so the call in flight returns at once)
and that thread closes the generator as soon as its call returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Iterator


class Completion(Iterator[int]):
    def __init__(self, tokens: Generator[int, None, None], *, stop: Callable[[], None]) -> None:
        self._tokens = tokens
        self._stop = stop  # frees the slot, releases the request on every stage, marks it cancelled
        self._step = threading.Lock()  # held by the thread running the generator
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
                token = next(self._tokens)
            except BaseException:
                self._over = True
                raise
            if self._aborted.is_set():  # aborted while this thread was in a stage call
                self._end()
                raise StopIteration
            return token

    def abort(self) -> None:
        """Stop now, from any thread (the client went away, or the reader is done with it); idempotent."""
        if self._over:
            return
        self._aborted.set()
        if not self._step.acquire(blocking=False):
            self._stop()  # a thread waits in the queue or on a stage: make it return; it ends the generator
            return
        try:
            if not self._started:
                self._stop()  # never ran, so its own cleanup never will
            self._end()
        finally:
            self._step.release()

    close = abort

    def _end(self) -> None:
        if not self._over:
            self._over = True
            self._tokens.close()  # suspended at a token: its cleanup frees the slot and the KV
