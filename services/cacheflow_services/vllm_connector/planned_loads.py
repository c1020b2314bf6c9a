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

With a draft whose KV restores rerun (`draft.py`), a restore's draft reruns once its loads ended, in `collect`,
before it is reported. On tensor-parallel ranks those forwards run the ranks' collectives, so the ranks first
agree which restores ended on every rank (a MIN over the group, at each `collect` while any is in flight: every
rank calls it after every step, with the same restores in flight, in the order the step started them) and
rerun the drafts of those alone, together; a restore that could not start stays listed, as ended, until then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cacheflow_services.vllm_connector.async_loads import IDLE_SLICE_S
from cacheflow_services.vllm_connector.draft import Restored
from cacheflow_services.vllm_connector.plan import LoadSpec
from cacheflow_services.vllm_connector.planned_split import RunningSplit, Split


class PlannedRestorer(Protocol):
    """What the worker engine lends the planned background restores."""

    def start_splits(self, specs: Sequence[LoadSpec], *, on_loaded: Callable[[], None]
                     ) -> list[RunningSplit | BaseException]: ...
    def split_done(self, spec: LoadSpec, done: Split, *, elapsed_s: float, asynchronous: bool) -> set[int]: ...
    def failed_load(self, spec: LoadSpec, exc: BaseException) -> set[int]: ...
    @property
    def drafts(self) -> bool: ...  # restores rerun a draft
    def agree_min(self, values: list[int]) -> list[int]: ...  # each value's least over the tensor-parallel ranks
    def rerun_drafts(self, restored: Sequence[Restored]) -> set[int]: ...  # the blocks vLLM must recompute


@dataclass
class _Running:
    spec: LoadSpec
    split: RunningSplit | None  # None: it could not start (a draft's restore, kept for the ranks' agreement)
    started_s: float
    failed: frozenset[int] = frozenset()  # the blocks of one that could not start

    @property
    def ended(self) -> bool:
        return self.split is None or self.split.loads.ended


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
                failed = self.restorer.failed_load(spec, split)  # vLLM recomputes it
                if self.restorer.drafts:  # reported when every rank's ended
                    self._running[spec.req_id] = _Running(spec, None, started, frozenset(failed))
                else:
                    self._finished[spec.req_id] = failed
            else:
                self._running[spec.req_id] = _Running(spec, split, started)

    def collect(self, finished_requests: Iterable[str], *, idle: bool) -> tuple[set[str], set[int]]:
        """Report the restores that ended since the last call, and the blocks vLLM must recompute. `idle`: the
        step scheduled nothing, so wait for one to end (at most `IDLE_SLICE_S`, as the engine's restores do).
        `finished_requests`: requests vLLM finished."""
        if idle and self._running and not self._any_ended():
            with self._ended:
                self._ended.wait_for(self._any_ended, timeout=IDLE_SLICE_S)
        aborted = set(finished_requests)
        restored = []
        for request_id, late in self._ending(aborted).items():
            running = self._running.pop(request_id)
            self._finished[request_id], end = self._end(running, aborted=request_id in aborted, late=late)
            if self.restorer.drafts and request_id not in aborted:
                split = running.split
                restored.append(Restored(running.spec, split.job if split else None, split.kv if split else None, end))
        failed = self.restorer.rerun_drafts(restored) if restored else set()  # before vLLM reads the blocks
        finished, self._finished = self._finished, {}
        return set(finished), failed.union(*finished.values())

    def _ending(self, aborted: set[str]) -> dict[str, bool]:
        """The restores to report now, each with whether it ran past its timeout: those whose loads ended, that
        vLLM finished, or that are late; with a draft, those that did on every rank."""
        now = time.perf_counter()
        late = {request_id: now - running.started_s > self.timeout_s for request_id, running in self._running.items()}
        ended = [int(request_id in aborted or late[request_id] or running.ended)
                 for request_id, running in self._running.items()]
        if self.restorer.drafts and ended:
            ended = self.restorer.agree_min(ended)  # a collective: every rank, with as many values
        return {request_id: late[request_id] for request_id, ok in zip(self._running, ended, strict=True) if ok}

    @property
    def in_flight(self) -> int:
        return len(self._running)

    def close(self) -> None:
        """Stop every restore still loading (vLLM is shutting down)."""
        for running in self._running.values():
            if running.split is not None:
                running.split.result(stop=True)
        self._running.clear()

    def _end(self, running: _Running, *, aborted: bool, late: bool) -> tuple[set[int], int]:
        """The blocks vLLM must recompute, and where what the restore wrote ends."""
        done = running.split.result(stop=aborted or late) if running.split is not None else None
        if aborted:  # nobody reads the blocks (vLLM may have handed them to another request)
            return set(), running.spec.start
        if done is None:
            return set(running.failed), running.spec.start
        return self.restorer.split_done(running.spec, done, elapsed_s=time.perf_counter() - running.started_s,
                                        asynchronous=True), done.end

    def _any_ended(self) -> bool:
        return any(running.ended for running in self._running.values())

    def _notify(self) -> None:
        with self._ended:
            self._ended.notify_all()
