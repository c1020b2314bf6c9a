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

import torch

from cacheflow_common.engine.builder import RestoreBuilder
from cacheflow_common.engine.channels import ChannelLoader
from cacheflow_common.engine.core import EngineCore, ForwardItem
from cacheflow_common.engine.settings import EngineSettings
from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.engine.step_loop import Sampler, StepLoop, StepPlan
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.job import ChunkComputed, RestoreJob, RestoreResult
from cacheflow_common.restore.stage_input import StageInput
from cacheflow_common.sched.policies import make_policy
from cacheflow_common.stage_api import RestoreSummary
from cacheflow_common.store.base import ChunkStore

JOIN_S = 10.0  # longest wait for the loop and the channels at close


class RestoreEngine:
    """A stage's engine; threads start at construction and stop at `close` (or the end of a `with`).

    `loop_thread`: the compute loop runs on a thread of its own (a stage worker: request threads only
    submit and wait), or on the thread that calls `restore_batch` (the library, the vLLM connector: the
    caller would only wait, and torch keeps its thread pool, warm, with the thread that runs it).
    """

    def __init__(self, settings: EngineSettings, model: Transformer, *, sampler: Sampler | None = None,
                 on_step: Callable[[StepPlan, float], None] | None = None,
                 on_load: Callable[[int, float], None] | None = None, loop_thread: bool = True) -> None:
        self.settings = settings
        self.model = model
        self.core = EngineCore(make_policy(settings.policy), stage=settings.stage, n_channels=len(settings.channels))
        self.builder = RestoreBuilder(settings, model, on_input=self.core.wake)
        self.loop = StepLoop(self.core, model, settings.layers, step_tokens=settings.step_tokens,
                        beside_forward_tokens=settings.beside_forward_tokens, sampler=sampler or _no_sampling,
                        on_step=on_step or (lambda plan, seconds: None))
        self._loop = threading.Thread(target=self.loop.run, name=f"stage-{settings.stage}-loop",
                                      daemon=True) if loop_thread else None  # None: the caller computes
        if self._loop is not None:
            self._loop.start()
        self._channels = [ChannelLoader(self.core, c, on_load=on_load or (lambda channel, seconds: None)).start()
                          for c in range(len(settings.channels))]

    # -- restores -----------------------------------------------------------------------------
    def submit(self, restore: StageRestore) -> StageRestore:
        """Hand a built restore to the scheduler; its `done` future answers with its summary."""
        self.core.admit(restore)
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
                started[request_id] = self.submit(self.builder.build(
                    request_id, job, store, kv, policy or self.settings.policy, input_mode=input_mode,
                    arrival_s=arrival, inputs=inputs, on_computed=on_computed))
            except Exception as exc:  # this request's restore cannot start: the caller falls back for it
                results[request_id] = exc
        self.wait(list(started.values()))
        for request_id, restore in started.items():
            try:
                results[request_id] = as_result(restore, restore.done.result())
            except Exception as exc:
                results[request_id] = exc
        return results

    def wait(self, restores: list[StageRestore]) -> None:
        """Until every one of `restores` is answered: on the loop thread, or by running the loop here."""
        if self._loop is None:
            self.loop.run(until=lambda: all(restore.done.done() for restore in restores))

    def cancel(self, request_id: str, error: BaseException) -> bool:
        """Stop a restore still running (its waiter gets `error`); False if none runs for the request."""
        with self.core.cond:
            if request_id not in self.core.restores:
                return False
            self.core.fail(request_id, error)
            self.core.cond.notify_all()
            return True

    def unit_tokens(self, request_id: str, unit: int) -> int:
        """Tokens of a restoring request's unit (0 once it is no longer restoring)."""
        with self.core.cond:
            restore = self.core.restores.get(request_id)
        if restore is None:
            return 0
        start, end = restore.unit_tokens[unit]
        return end - start

    # -- forward work -------------------------------------------------------------------------
    def forward(self, item: ForwardItem) -> torch.Tensor | int:
        """Run new tokens of a request in the loop's next steps; the rows leaving the stage, [T, hidden], or
        (given a sampler, with `item.sample`) the next token."""
        with self.core.cond:
            self.core.forwards.append(item)
            self.core.cond.notify_all()
        if self._loop is None:
            self.loop.run(until=item.future.done)
        return item.future.result()

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the loop and the channels (requests in flight get no answer)."""
        with self.core.cond:
            self.core.stopped = True
            self.core.cond.notify_all()
        if self._loop is not None:
            self._loop.join(JOIN_S)
        for channel in self._channels:
            channel.join(JOIN_S)

    def __enter__(self) -> RestoreEngine:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def as_result(restore: StageRestore, summary: RestoreSummary) -> RestoreResult:
    """A finished restore as the library reports it: its KV, its units and its summary's counts."""
    return RestoreResult(policy=summary.policy, mode=summary.mode, kv=restore.kv, units=restore.records,
                         elapsed_s=summary.elapsed_s, bytes_loaded=summary.bytes_loaded,
                         misses=Counter(summary.misses), fallback=summary.fallback)


def _no_sampling(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    raise AssertionError("this engine restores KV only: its caller runs the forward passes that sample")
