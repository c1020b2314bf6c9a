"""One thread that runs a process's saves in order, off the critical path (and off the compute cores):
a stage worker's and the vLLM connector's. A save that fails is logged with its request id and reported
to `on_failure`, never raised: the chunk it would have stored is recomputed by a later restore."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cacheflow_common.restore.cores import move_off_compute_cores

log = logging.getLogger(__name__)


class SaverThread:
    def __init__(self, name: str, on_failure: Callable[[str, Exception], None]) -> None:
        self.on_failure = on_failure  # (request id, error): count it
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=move_off_compute_cores)

    def submit(self, request_id: str, save: Callable[[], object]) -> None:
        self._pool.submit(self._run, request_id, save)

    def flush(self) -> None:
        """Wait for every queued save."""
        try:
            self._pool.submit(lambda: None).result()
        except RuntimeError:  # the interpreter is exiting: its shutdown hook has run the queued saves already
            return

    def close(self) -> None:
        self.flush()
        self._pool.shutdown()

    def _run(self, request_id: str, save: Callable[[], object]) -> None:
        try:
            save()
        except Exception as exc:
            log.exception("%s: storing its chunks failed", request_id)
            self.on_failure(request_id, exc)
