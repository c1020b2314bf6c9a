"""Planned restores (tensor-parallel ranks, restores by loads alone: `planned_split.py`) that do not hold
vLLM's batch back while their chunks load.

vLLM parks the request in WAITING_FOR_REMOTE_KVS, as for the other background restores (`async_loads.py`).
In the step that starts it, every rank recomputes its front with vLLM's model, as before: those forwards run
the ranks' collectives, so they must run in the same step on every rank, in the same order. Its back then
loads on a thread of its own while vLLM steps the rest of the batch, and `collect` (vLLM's thread, after
each step) reports the request once its loads ended, with the blocks vLLM must recompute from the first
miss on. vLLM reports a request to its scheduler only once every rank did, with the union of their failed
blocks, so ranks whose loads end at different steps still agree.

Every load is reported exactly once: when its loads end, when vLLM finished the request meanwhile (its
loads stop, nothing is recomputed), or when it runs past `timeout_s` (its loads stop, vLLM recomputes from
the last chunk landed). The blocks are sealed before the report: vLLM may reuse them as soon as it reads it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cacheflow_services.vllm_connector.async_loads import IDLE_SLICE_S
from cacheflow_services.vllm_connector.plan import LoadSpec
from cacheflow_services.vllm_connector.planned_split import RunningSplit, Split


class PlannedRestorer(Protocol):
    """What the worker engine lends the planned background restores."""

    def start_splits(self, specs: Sequence[LoadSpec], *, on_loaded: Callable[[], None]
                     ) -> list[RunningSplit | BaseException]: ...
    def split_done(self, spec: LoadSpec, done: Split, *, elapsed_s: float, asynchronous: bool) -> set[int]: ...
    def failed_load(self, spec: LoadSpec, exc: BaseException) -> set[int]: ...


@dataclass
class _Running:
    spec: LoadSpec
    split: RunningSplit
    started_s: float


class PlannedLoads:
    def __init__(self, restorer: PlannedRestorer, *, timeout_s: float) -> None:
        self.restorer = restorer
        self.timeout_s = timeout_s
        self._running: dict[str, _Running] = {}  # only vLLM's thread touches it
        self._finished: dict[str, set[int]] = {}  # request -> the blocks vLLM must recompute
        self._ended = threading.Condition()  # notified by a load thread as its loads end

    def start(self, specs: Sequence[LoadSpec]) -> None:
        """On vLLM's thread, in the step's order: the fronts recomputed now, each back loading from here on."""
        started = time.perf_counter()
        for spec, split in zip(specs, self.restorer.start_splits(specs, on_loaded=self._notify), strict=True):
            if isinstance(split, BaseException):  # it never started (or the fronts failed, its loads stopped)
                self._finished[spec.req_id] = self.restorer.failed_load(spec, split)  # vLLM recomputes it
            else:
                self._running[spec.req_id] = _Running(spec, split, started)

    def collect(self, finished_requests: Iterable[str], *, idle: bool) -> tuple[set[str], set[int]]:
        """Report the restores that ended since the last call, and the blocks vLLM must recompute. `idle`: the
        step scheduled nothing, so wait for one to end (at most `IDLE_SLICE_S`, as the engine's restores do).
        `finished_requests`: requests vLLM finished."""
        if idle and self._running and not self._any_ended():
            with self._ended:
                self._ended.wait_for(self._any_ended, timeout=IDLE_SLICE_S)
        aborted, now = set(finished_requests), time.perf_counter()
        for request_id, running in list(self._running.items()):
            late = now - running.started_s > self.timeout_s
            if request_id in aborted or late or running.split.loads.ended:
                del self._running[request_id]
                self._finished[request_id] = self._end(running, aborted=request_id in aborted, late=late)
        finished, self._finished = self._finished, {}
        return set(finished), set().union(*finished.values())

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def close(self) -> None:
        """Stop every restore still loading (vLLM is shutting down)."""
        for running in self._running.values():
            running.split.result(stop=True)
        self._running.clear()

    def _end(self, running: _Running, *, aborted: bool, late: bool) -> set[int]:
        done = running.split.result(stop=aborted or late)
        if aborted:  # nobody reads the blocks
            return set()
        return self.restorer.split_done(running.spec, done, elapsed_s=time.perf_counter() - running.started_s,
                                        asynchronous=True)

    def _any_ended(self) -> bool:
        return any(running.split.loads.ended for running in self._running.values())

    def _notify(self) -> None:
        with self._ended:
            self._ended.notify_all()
