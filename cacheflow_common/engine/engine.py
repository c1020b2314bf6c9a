"""The one two-pointer engine of a stage: one compute loop that owns the model and runs one batched forward
per step (`step_loop.StepLoop`), one loader per storage channel (`channels.ChannelLoader`), and one batch
scheduler that decides for both (`core.EngineCore`). Every restore runs here: a stage worker's (a batch
of requests and their forward work), the vLLM connector's (a step's loads together, or one), the
library's `restore()` (a batch of one), the profiler's and the benchmarks'.

Cake, load-only and compute-only are policies of the same engine (`cacheflow_common.sched.policies`).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING

import torch

from cacheflow_common.engine.builder import RestoreBuilder
from cacheflow_common.engine.channels import ChannelLoader
from cacheflow_common.engine.core import EngineCore
from cacheflow_common.engine.pool import KVPool
from cacheflow_common.engine.requests import RequestTable
from cacheflow_common.engine.settings import EngineSettings
from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.engine.step_loop import Sampler, StepLoop
from cacheflow_common.engine.step_plan import ForwardItem, StepBudget, StepPlan
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.job import ChunkComputed, RestoreJob, RestoreResult
from cacheflow_common.restore.stage_input import StageInput
from cacheflow_common.sched.policies import make_policy
from cacheflow_common.sched.scheduler import BatchScheduler
from cacheflow_common.stage_api import RestoreSummary
from cacheflow_common.store.base import ChunkStore

if TYPE_CHECKING:  # the engine need not load the grants' signature code (`engine/requests.py`)
    from cacheflow_common.auth import Grant

JOIN_S = 10.0  # longest wait for the loop and the channels at close
StepHook = Callable[[StepPlan, float], None]  # every step that ran, and its seconds
LoadHook = Callable[[int, float], None]  # every load: its channel and busy seconds


class Engine:
    """A stage's engine; threads start at construction and stop at `close` (or the end of a `with`).

    Made by `for_stage` (the compute loop on a thread of its own: a stage worker, whose request threads only
    submit and wait) or `for_connector` (the loop runs on the thread that calls `restore_batch`, `step` or
    `run_until`: the vLLM connector, the library; the caller would only wait, and torch keeps its thread
    pool, warm, with the thread that runs it). `scheduler`: the batch scheduler to decide with (default: a
    one-stage scheduler of the settings' policy), for a caller that instruments it.

    Every request the engine holds is one record in its `requests` table, keyed once: a stage worker's
    requests for their whole life there (admitted with KV from `pool`), and a restore's for as long as
    it runs.
    """

    def __init__(self, settings: EngineSettings, model: Transformer, *, loop_thread: bool, sampler: Sampler,
                 on_step: StepHook, on_load: LoadHook, scheduler: BatchScheduler | None, pool: KVPool | None = None,
                 on_stream_closed: Callable[[Grant], None] = lambda grant: None) -> None:
        self._settings = settings
        self._model = model
        scheduler = scheduler or BatchScheduler(make_policy(settings.policy), n_stages=1)
        self._core = EngineCore(scheduler, stage=settings.stage, n_channels=len(settings.channels), pool=pool,
                                on_stream_closed=on_stream_closed)
        self._builder = RestoreBuilder(settings, model, on_input=self._core.wake_loop)
        budget = StepBudget(step_tokens=settings.step_tokens, beside_forward_tokens=settings.beside_forward_tokens)
        self._step_loop = StepLoop(self._core, model, settings.layers, budget=budget, sampler=sampler,
                                   on_step=on_step)
        self._loop_thread = threading.Thread(target=self._step_loop.run, name=f"stage-{settings.stage}-loop",
                                             daemon=True) if loop_thread else None  # None: the caller computes
        if self._loop_thread is not None:
            self._loop_thread.start()
        self._channels = [ChannelLoader(self._core, c, on_load=on_load).start() for c in range(len(settings.channels))]

    @classmethod
    def for_stage(cls, settings: EngineSettings, model: Transformer, *, sampler: Sampler | None = None,
                  on_step: StepHook | None = None, on_load: LoadHook | None = None,
                  scheduler: BatchScheduler | None = None, pool: KVPool | None = None,
                  on_stream_closed: Callable[[Grant], None] | None = None) -> Engine:
        """A stage worker's engine: its compute loop on a thread of its own; `sampler` picks the last stage's
        next tokens; `on_step`, `on_load` hear of every step and load (metrics); `pool`: where its requests'
        KV comes from (`requests.admit`); `on_stream_closed`: a released request's delivery grant is used up."""
        return cls(settings, model, loop_thread=True, sampler=sampler or _no_sampling,
                   on_step=on_step or _ignore, on_load=on_load or _ignore, scheduler=scheduler, pool=pool,
                   on_stream_closed=on_stream_closed or _ignore)

    @classmethod
    def for_connector(cls, settings: EngineSettings, model: Transformer, *, on_step: StepHook | None = None,
                      scheduler: BatchScheduler | None = None) -> Engine:
        """An engine that restores KV only, computing on its caller's thread (the vLLM connector, the
        library's `restore()`)."""
        return cls(settings, model, loop_thread=False, sampler=_no_sampling, on_step=on_step or _ignore,
                   on_load=_ignore, scheduler=scheduler)

    @property
    def settings(self) -> EngineSettings:
        return self._settings

    @property
    def model(self) -> Transformer:
        return self._model

    @property
    def requests(self) -> RequestTable:
        """The stage's requests, one record each (admit, deliver, release: `RequestTable`)."""
        return self._core.request_table()

    # -- restores -----------------------------------------------------------------------------
    def submit(self, request_id: str, job: RestoreJob, store: ChunkStore, kv: KVBuffer, *, policy: str = "",
               input_mode: str = "boundary", arrival_s: float | None = None, inputs: StageInput | None = None,
               on_computed: ChunkComputed | None = None, on_loaded: Callable[[int], None] | None = None
               ) -> StageRestore:
        """Start restoring `job` into `kv`; the restore's `done` future answers with its summary.

        `policy`: the settings' by default; `arrival_s`: when the request arrived, on this process's
        perf_counter clock (the scheduler's; default now); `inputs`, `on_computed`, `on_loaded`: see
        `RestoreBuilder.build`.
        An error here means the restore never started."""
        restore = self._builder.build(request_id, job, store, kv, policy or self.settings.policy,
                                      input_mode=input_mode, inputs=inputs, on_computed=on_computed,
                                      on_loaded=on_loaded,
                                      arrival_s=time.perf_counter() if arrival_s is None else arrival_s)
        self._core.admit_restore(restore)
        return restore

    def restore_batch(self, jobs: Mapping[str, RestoreJob], store: ChunkStore, policy: str = "", *,
                      kvs: Mapping[str, KVBuffer] | None = None, inputs: StageInput | None = None,
                      input_mode: str = "boundary",
                      on_computed: ChunkComputed | None = None) -> dict[str, RestoreResult | Exception]:
        """Restore every job at once (into `kvs[request]`, or a new buffer each); by request id, its result,
        or the error that stopped it (a restore that cannot start or fails does not stop the others).
        `inputs` and `on_computed` (see `RestoreBuilder.build`) serve every job: a batch of one's."""
        arrival = time.perf_counter()
        results: dict[str, RestoreResult | Exception] = {}
        started: dict[str, StageRestore] = {}
        for request_id, job in jobs.items():
            kv = kvs[request_id] if kvs else self.model.new_kv(job.layers, max(1, len(job.token_ids)))
            try:
                started[request_id] = self.submit(request_id, job, store, kv, policy=policy, input_mode=input_mode,
                                                  arrival_s=arrival, inputs=inputs, on_computed=on_computed)
            except Exception as exc:  # this request's restore cannot start: the caller falls back for it
                results[request_id] = exc
        if self._loop_thread is None:
            self.run_until(lambda: all(restore.done.done() for restore in started.values()))
        for request_id, restore in started.items():
            try:
                results[request_id] = as_result(restore, restore.done.result())
            except Exception as exc:
                results[request_id] = exc
        return results

    def cancel(self, request_id: str, error: BaseException) -> bool:
        """Stop a restore still running (its waiter gets `error`); False if none runs for the request."""
        return self._core.cancel_restore(request_id, error)

    def unit_tokens(self, request_id: str, unit: int) -> int:
        """Tokens of a restoring request's unit (0 once it is no longer restoring)."""
        restore = self._core.restore_of(request_id)
        if restore is None:
            return 0
        start, end = restore.unit_tokens[unit]
        return end - start

    # -- computing on the caller's thread (`for_connector`) ------------------------------------------
    def step(self) -> bool:
        """One compute step now, if there is work (never waits); False when there was none."""
        return self._step_loop.step(wait=False)

    def run_until(self, done: Callable[[], bool]) -> None:
        """Compute on this thread until `done()` holds (waiting for work in between, a bounded wait at a time:
        `done` may turn true without the engine hearing of it)."""
        self._step_loop.run(until=done)

    # -- forward work -------------------------------------------------------------------------
    def forward(self, item: ForwardItem) -> torch.Tensor | int:
        """Run new tokens of a request in the loop's next steps; the rows leaving the stage, [T, hidden], or
        (given a sampler, with `item.sample`) the next token."""
        self._core.queue_forward(item)
        if self._loop_thread is None:
            self.run_until(item.future.done)
        return item.future.result()

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the loop and the channels (requests in flight get no answer)."""
        self._core.shut_down()
        if self._loop_thread is not None:
            self._loop_thread.join(JOIN_S)
        for channel in self._channels:
            channel.join(JOIN_S)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def as_result(restore: StageRestore, summary: RestoreSummary) -> RestoreResult:
    """A finished restore as the library reports it: its KV, its units and its summary's counts."""
    return RestoreResult(policy=summary.policy, mode=summary.mode, kv=restore.kv, units=restore.records(),
                         elapsed_s=summary.elapsed_s, bytes_loaded=summary.bytes_loaded,
                         boundary_bytes_read=summary.boundary_bytes_read, misses=Counter(summary.misses),
                         fallback=summary.fallback)


def _ignore(*_: object) -> None:
    """No hook."""


def _no_sampling(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    raise AssertionError("this engine restores KV only: its caller runs the forward passes that sample")
