"""The stage's I/O resources: one loader thread per storage channel (a pod link).

Each asks the batch scheduler for the next (request, unit) its channel should load, loads it into that
request's KV buffer (bytes only: no torch ops, so it does not take compute's threads; pinned off the
compute cores as well), and reports it loaded or missed. A failed read is a miss: the unit goes back
to compute. Threads stay off the compute cores (`move_off_compute_cores`), as on a GPU the copy
engines are not the SMs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from cacheflow_common.engine.core import EngineCore
from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.restore.cores import move_off_compute_cores
from cacheflow_common.restore.loader import staging_buffer

log = logging.getLogger(__name__)


class ChannelLoader:
    def __init__(self, core: EngineCore, channel: int, *, on_load: Callable[[int, float], None]) -> None:
        self.core = core
        self.channel = channel
        self.on_load = on_load  # metrics: (channel, busy seconds) after every load
        self._staging = staging_buffer(0)
        self._thread = threading.Thread(target=self._run, name=f"channel-{channel}", daemon=True)

    def start(self) -> ChannelLoader:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        move_off_compute_cores()
        while self._load_next():
            pass

    def _load_next(self) -> bool:
        """Load the next unit the scheduler gives this channel; False once the engine stopped. Its own frame,
        so that nothing of the request it loaded (its KV buffer) stays referenced while the thread waits."""
        claim = self.core.wait_for_load(self.channel)
        if claim is None:
            return False
        task, restore = claim
        started = time.perf_counter()
        miss = self._load(restore, task.unit)
        ended = time.perf_counter()
        restore.loaded(task.unit, started, ended, miss)
        self.core.report_load(self.channel, task, miss, ended)
        self.on_load(self.channel, ended - started)
        return True

    def _load(self, restore: StageRestore, unit: int) -> str:
        if len(self._staging) < restore.loader.staging_bytes:
            self._staging = staging_buffer(restore.loader.staging_bytes)
        try:
            return restore.load(unit, self._staging)
        except Exception as exc:  # a read that failed in any way is a miss: the unit is recomputed
            log.warning("channel %d: loading unit %d of %s failed: %s", self.channel, unit, restore.request_id, exc)
            return f"loader-error: {type(exc).__name__}"
