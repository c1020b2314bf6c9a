"""The loads of one vLLM step restored together, as a CacheFlow stage worker restores its batch: the
stage engine's batch scheduler, one compute loop running one batched forward per step over every
request's units, and one loader per storage pod, all shared by the step's requests, with the same
policies and the same channel ranking (`cacheflow_services.worker`). The connector is a one-stage engine
over its vLLM rank's layers: all of them, fed by the token embeddings, or (a pipeline-parallel rank after the
first) [a, b), fed by the stored boundary activations entering layer a.

A request's restore that fails (its plan cannot be built, the engine gives up on it) is answered with
its error; the others go on.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import torch

from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.executor import RestoreJob, RestoreResult
from cacheflow_common.restore.profile import Profile
from cacheflow_common.sched.policies import make_policy
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_services.vllm_connector.config import ConnectorConfig
from cacheflow_services.worker.channels import ChannelLoader
from cacheflow_services.worker.config import WorkerConfig
from cacheflow_services.worker.core import EngineCore
from cacheflow_services.worker.restore_builder import RestoreBuilder
from cacheflow_services.worker.stage_restore import StageRestore
from cacheflow_services.worker.step_loop import StepLoop

JOIN_S = 10.0  # longest wait for the loop and the channels at close


def engine_config(cfg: ConnectorConfig, layers: range, token: str) -> WorkerConfig:
    """The connector's settings as a one-stage worker's over the rank's layers (stage 1 stands for any rank
    after the first: its restores read boundary activations)."""
    return WorkerConfig(stage=int(layers.start > 0), layers=layers, last_stage=True, model=cfg.model,
                        chunk_size=cfg.chunk_size,
                        pods=tuple(PodAddress.parse(p) for p in cfg.pods), pod_tokens={cfg.tenant: token},
                        replicas=cfg.replicas, policy=cfg.policy, profile=Path(cfg.profile) if cfg.profile else None,
                        link_gbps=cfg.link_gbps or None)


class BatchRestorer:
    def __init__(self, config: WorkerConfig, model: Transformer, store: ChunkStore, profile: Profile | None) -> None:
        self.config = config
        self.model = model
        self.store = store
        self.core = EngineCore(make_policy(config.policy), stage=config.stage)
        self.builder = RestoreBuilder(config, model, profile, on_input=self.core.wake)
        loop = StepLoop(self.core, model, config.layers, step_tokens=config.step_tokens, beside_forward_tokens=0,
                        sampler=_no_sampling, on_step=lambda plan, seconds: None)
        self._threads = [threading.Thread(target=loop.run, name="cacheflow-batch-loop", daemon=True)]
        self._threads[0].start()
        self._channels = [ChannelLoader(self.core, c, on_load=lambda channel, seconds: None).start()
                          for c in range(len(config.pods))]

    def restore(self, jobs: dict[str, RestoreJob], policy: str) -> dict[str, RestoreResult | Exception]:
        """Restore every job at once (each into a KV buffer of its own); by request id, its result or error."""
        arrival = time.perf_counter()
        results: dict[str, RestoreResult | Exception] = {}
        admitted: dict[str, StageRestore] = {}
        for request_id, job in jobs.items():
            kv = self.model.new_kv(job.layers, max(1, len(job.token_ids)))
            try:
                restore = self.builder.build(request_id, job, self.store, kv, policy, input_mode="boundary",
                                             upstream=None, on_computed=None, arrival_s=arrival)
                self.core.admit(restore)
            except Exception as exc:  # this request's restore cannot start: the caller falls back for it
                results[request_id] = exc
                continue
            admitted[request_id] = restore
        for request_id, restore in admitted.items():
            try:
                summary = restore.done.result()
            except Exception as exc:
                results[request_id] = exc
                continue
            results[request_id] = RestoreResult(
                policy=summary.policy, mode=summary.mode, kv=restore.kv, units=restore.records,
                elapsed_s=summary.elapsed_s, bytes_loaded=summary.bytes_loaded, misses=Counter(summary.misses))
        return results

    def close(self) -> None:
        with self.core.cond:
            self.core.stopped = True
            self.core.cond.notify_all()
        for thread in self._threads:
            thread.join(JOIN_S)
        for channel in self._channels:
            channel.join(JOIN_S)


def _no_sampling(logits: torch.Tensor, temperature: float, seed: int, position: int) -> int:
    raise AssertionError("the connector's engine restores KV only: vLLM runs the forward passes and samples")
