"""Planned restores (tensor-parallel ranks, restores by loads alone: `planned_split.py`) that do not hold
vLLM's batch back while their chunks load.

vLLM parks the request in WAITING_FOR_REMOTE_KVS, as for the other background restores (`async_loads.py`).
In the step that starts it, every rank recomputes the first step of its front with vLLM's model, and one more step
of it in each later `collect` (vLLM's thread, after each step), as vLLM's chunked prefill spreads a prompt
(`planned_fronts.py`): those forwards run the ranks' collectives, so they must run in the same step on every rank,
in the same order, and they depend on nothing but what every rank has in the same step (the restores started, the
requests vLLM finished). The fronts of one step's restores step after those started before them, one step of fronts
per vLLM step; a step that scheduled nothing else runs every step left (vLLM too lifts its cap on a prefill that has
no request to starve). Its back loads on a thread of its own meanwhile, while vLLM steps the rest of the batch, and
`collect` reports the request once its front is in the blocks and its loads ended, with the blocks vLLM must
recompute from the first miss on.
vLLM reports a request to its scheduler only once every rank did, with the union of their failed
blocks, so ranks whose loads end at different steps still agree.

Every load is reported exactly once: when its front and loads end, when vLLM finished the request meanwhile
(the rest of its front is left out, its loads stop, nothing is recomputed), when its front's forwards fail
(vLLM recomputes it all), or when it runs past `timeout_s` once its front is done (its loads stop, vLLM
recomputes from the last chunk landed; a front still stepping is never cut short on one rank alone).
The blocks are sealed before the report: vLLM may reuse them as soon as it reads it.

With a draft whose KV restores rerun (`draft.py`), a restore's draft reruns once its loads ended, in `collect`,
before it is reported. On tensor-parallel ranks those forwards run the ranks' collectives, so the ranks first
agree which restores ended on every rank (a MIN over the group, at each `collect` while any is in flight: every
rank calls it after every step, with the same restores in flight, in the order the step started them) and
rerun the drafts of those alone, together; a restore that could not start stays listed, as ended, until then.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cacheflow_services.vllm_connector.async_loads import IDLE_SLICE_S
from cacheflow_services.vllm_connector.draft import Restored
from cacheflow_services.vllm_connector.plan import LoadSpec
from cacheflow_services.vllm_connector.planned_fronts import Fronts
from cacheflow_services.vllm_connector.planned_split import RunningSplit, Split, stop_fronts

log = logging.getLogger(__name__)


class PlannedRestorer(Protocol):
    """What the worker engine lends the planned background restores."""

    def start_splits(self, specs: Sequence[LoadSpec], *, on_loaded: Callable[[], None], in_steps: bool
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
        return self.split is None or self.split.ended

    @property
    def stepping(self) -> bool:
        """Its front still has steps to run."""
        return self.split is not None and self.split.fronts is not None and self.split.fronts.pending


class PlannedLoads:
    def __init__(self, restorer: PlannedRestorer, *, timeout_s: float) -> None:
        self.restorer = restorer
        self.timeout_s = timeout_s
        self._running: dict[str, _Running] = {}  # only vLLM's thread touches it
        self._finished: dict[str, set[int]] = {}  # request -> the blocks vLLM must recompute
        self._ended = threading.Condition()  # notified by a load thread as its loads end
        self._fronts: deque[tuple[Fronts, list[RunningSplit]]] = deque()  # fronts with steps to run, oldest first
        self._started_fronts = False  # this step started fronts (they ran their first step)

    def start(self, specs: Sequence[LoadSpec]) -> None:
        """On vLLM's thread, in the step's order: the fronts recomputed now, each back loading from here on."""
        started = time.perf_counter()
        splits = self.restorer.start_splits(specs, on_loaded=self._notify, in_steps=True)
        self._queue_fronts([split for split in splits if isinstance(split, RunningSplit)])
        for spec, split in zip(specs, splits, strict=True):
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
        aborted = set(finished_requests)
        self._step_fronts(aborted, idle=idle)
        if idle and self._running and not self._fronts and not self._any_ended():
            with self._ended:
                self._ended.wait_for(self._any_ended, timeout=IDLE_SLICE_S)
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
        late = {request_id: now - running.started_s > self.timeout_s and not running.stepping
                for request_id, running in self._running.items()}
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
        self._fronts.clear()

    def _end(self, running: _Running, *, aborted: bool, late: bool) -> tuple[set[int], int]:
        """The blocks vLLM must recompute, and where what the restore wrote ends."""
        split = running.split
        failed = split.failed if split is not None else None
        done = split.result(stop=aborted or late or failed is not None) if split is not None else None
        if aborted:  # nobody reads the blocks (vLLM may have handed them to another request)
            return set(), running.spec.start
        if done is None:
            return set(running.failed), running.spec.start
        if failed is not None:  # its front's forwards failed: nothing of it counts
            return self.restorer.failed_load(running.spec, failed), running.spec.start
        return self.restorer.split_done(running.spec, done, elapsed_s=time.perf_counter() - running.started_s,
                                        asynchronous=True), done.end

    def _queue_fronts(self, splits: list[RunningSplit]) -> None:
        """The fronts of restores that started this step, to step after those before them."""
        fronts = splits[0].fronts if splits else None
        self._started_fronts = fronts is not None and fronts.pending
        if fronts is not None and fronts.pending:
            self._fronts.append((fronts, splits))

    def _step_fronts(self, aborted: set[str], *, idle: bool) -> None:
        """The fronts' next step: of the oldest fronts with steps left, unless fronts started this step (they ran
        their first); in a step that scheduled nothing (`idle`), every step left of them all, as vLLM lifts its
        cap on a prefill that has no request to starve. The slices of requests vLLM finished are left out
        first. A step that fails stops its restores' loads and seals their blocks: they are reported as failed."""
        for request_id in aborted & self._running.keys():
            split = self._running[request_id].split
            if split is not None and split.fronts is not None:
                split.fronts.drop(split.plan)
        while self._fronts and not self._fronts[0][0].pending:  # every request of them finished
            self._fronts.popleft()
        while self._fronts and (idle or not self._started_fronts):
            fronts, splits = self._fronts.popleft()
            try:
                fronts.step(rest=idle)
            except Exception:
                log.exception("CacheFlow: a step of planned restores' fronts failed; vLLM recomputes them")
                stop_fronts(splits)
            if fronts.pending:
                self._fronts.appendleft((fronts, splits))
            if not idle:
                break
        self._started_fronts = False

    def _any_ended(self) -> bool:
        return any(running.ended for running in self._running.values())

    def _notify(self) -> None:
        with self._ended:
            self._ended.notify_all()
