"""The stage workers and storage pods a coordinator drives: what model they serve, and which answer.

At start the coordinator asks every stage for `/v1/info` (waiting while they come up) and checks that
they serve one model with one chunk size and layer ranges that tile it in order. A background thread
then probes each worker (`/readyz`: up, and whether its KV pool has room) and each storage pod (a small
data-plane request) every few seconds; a request is refused at once while a stage is down instead of
hanging on it, and the coordinator is not ready while a stage's pool is full. A pod that is down needs
no refusal: the workers recompute what it held.

A request that finds a stage down waits for it `stage_wait_s`, and past that for as long as the
supervisor says it is restarting that stage (`restarts_file`: a worker reloading its model on a
loaded host can take longer than any fixed wait), never more than `stage_restart_wait_s` in all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import httpx

from cacheflow_common.auth import GrantIssuer, GrantSigner
from cacheflow_common.errors import CacheFlowError, ConfigError
from cacheflow_common.stage_api import WorkerInfo
from cacheflow_common.store.placement import ClusterStore, tenant_stores
from cacheflow_common.transport.pod_client import PodClient
from cacheflow_services.coordinator.config import CoordinatorConfig
from cacheflow_services.coordinator.stage_chain import ChainError, StageChain
from cacheflow_services.http_server import http_client
from cacheflow_services.supervisor import restart_in_progress

log = logging.getLogger(__name__)
PROBE_NAME = "cacheflow-health-probe"  # a name no chunk has: a pod that answers about it is up
PROBE_TIMEOUT_S = 2.0
STAGE_POLL_S = 0.25  # how often a request waiting for a stage that is down probes it


class StageDownError(CacheFlowError):
    """A stage worker does not answer: requests are refused until it does (HTTP 503)."""


@dataclass(frozen=True)
class ModelInfo:
    fingerprint: str  # salts chunk keys: the same on every stage
    chunk_size: int
    vocab_size: int
    max_tokens: int  # the longest prompt + generation a request may hold
    stage_layers: tuple[range, ...]
    kv_heads: int = 0  # the model's KV heads: chunks stored split by heads (vLLM's TP ranks') count too


class Cluster:
    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        # a delivery grant lasts as long as the restore it feeds may take: one stage call
        issuer = GrantIssuer(config.internal_token, GrantSigner(config.grant_signing_key), config.pod_tokens,
                             stream_ttl_s=config.stage_timeout_s)
        self.chain = StageChain(config.stages, issuer=issuer, timeout_s=config.stage_timeout_s,
                                max_requests=config.max_batch, tls=config.tls)
        tls = config.tls.client_context() if config.tls else None
        self.stores: dict[str, ClusterStore] = tenant_stores(config.pods, config.pod_tokens, replicas=config.replicas,
                                                             tls=tls)
        first_token = next(iter(config.pod_tokens.values()))
        self._probes = {a.pod_id: PodClient(a, first_token, timeout_s=PROBE_TIMEOUT_S, tls=tls) for a in config.pods}
        self._probe_http = http_client(timeout=PROBE_TIMEOUT_S, tls=config.tls)
        self.stage_up = [True] * len(config.stages)
        self.stage_full = [False] * len(config.stages)  # up, but its KV pool has no room for a typical request
        self.pod_up = dict.fromkeys(self._probes, True)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.model: ModelInfo | None = None

    # ------------------------------------------------------------------------------------ start
    def connect(self, wait_s: float = 120.0) -> ModelInfo:
        """Wait until every stage answers `/v1/info`, check they fit together, start the health probes."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                infos = self.chain.info()
                break
            except ChainError as exc:
                if time.monotonic() > deadline:
                    raise ConfigError(f"stage workers not reachable after {wait_s:.0f} s: {exc}") from exc
                time.sleep(0.5)
        self.model = model_info(infos)
        self._thread = threading.Thread(target=self._probe_loop, name="health", daemon=True)
        self._thread.start()
        return self.model

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=PROBE_TIMEOUT_S * 2)
        self.chain.close()
        for store in self.stores.values():
            store.close()
        for probe in self._probes.values():
            probe.close()
        self._probe_http.close()

    # ------------------------------------------------------------------------------------ health
    def down_stages(self) -> list[int]:
        return [s for s, up in enumerate(self.stage_up) if not up]

    def require_stages(self) -> None:
        """Raise StageDownError naming the stages that do not answer."""
        if down := self.down_stages():
            how = " (being restarted)" if self.restarting(down) else ""
            raise StageDownError(f"stage worker(s) {', '.join(map(str, down))} not answering{how}; retry later")

    def restarting(self, stages: list[int]) -> bool:
        """Whether the supervisor says it is restarting every one of `stages` (False when nothing is known)."""
        state = self.config.restarts_file
        return state is not None and all(restart_in_progress(state, f"stage {s}") for s in stages)

    def wait_for_stages(self, timeout_s: float, *, gone: Callable[[], bool] = lambda: False) -> None:
        """Return once every stage answers, probing them meanwhile; StageDownError naming those still down
        after `timeout_s`, or, while the supervisor is restarting all of them, after the hard bound
        (`stage_restart_wait_s`), or as soon as `gone` (the request's client left)."""
        began = time.monotonic()
        bound = max(timeout_s, self.config.stage_restart_wait_s)
        while down := self.down_stages():
            waited = time.monotonic() - began
            if waited >= bound or (waited >= timeout_s and not self.restarting(down)) or gone():
                break
            time.sleep(STAGE_POLL_S)
            self.probe_stages()
        self.require_stages()

    def mark_stage_down(self, stage: int) -> None:
        """A request found the stage unreachable: refuse others at once until a probe sees it again."""
        if 0 <= stage < len(self.stage_up):
            self.stage_up[stage] = False

    def status(self) -> dict[str, Any]:
        return {"stages": [{"stage": s, "url": url, "up": self.stage_up[s], "pool_full": self.stage_full[s]}
                           for s, url in enumerate(self.chain.urls)],
                "pods": [{"pod": pod_id, "up": up} for pod_id, up in self.pod_up.items()]}

    def probe(self) -> None:
        """Probe every worker and pod once."""
        self.probe_stages()
        for pod_id, client in self._probes.items():
            before = client.last_failure
            client.size(PROBE_NAME)  # a failure is swallowed but recorded
            self.pod_up[pod_id] = client.last_failure == before

    def probe_stages(self) -> None:
        """Each stage's /readyz: 200 up with room; 503 with its readiness up but its pool full; else down."""
        for stage, url in enumerate(self.chain.urls):
            try:
                answer = self._probe_http.get(f"{url}/readyz")
                full = answer.status_code == 503 and answer.json().get("ready") is False
            except (httpx.HTTPError, ValueError):
                answer, full = None, False
            self.stage_up[stage] = answer is not None and (answer.status_code == 200 or full)
            self.stage_full[stage] = full

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.config.health_interval_s):
            try:
                self.probe()
            except Exception:  # the probes must outlive any surprise
                log.exception("health probe failed")


def model_info(infos: list[WorkerInfo]) -> ModelInfo:
    """What the stages serve; ConfigError when they do not form one pipeline of one model."""
    first = infos[0]
    for s, info in enumerate(infos):
        for key in ("model", "chunk_size", "vocab_size"):
            if getattr(info, key) != getattr(first, key):
                raise ConfigError(f"stage {s} has {key} {getattr(info, key)!r}, stage 0 has {getattr(first, key)!r}")
        if info.stage != s:
            raise ConfigError(f"the worker listed as stage {s} says it is stage {info.stage}")
    layers = tuple(range(*info.layers) for info in infos)
    if layers[0].start != 0 or any(a.stop != b.start for a, b in pairwise(layers)):
        raise ConfigError(f"stage layer ranges {[(r.start, r.stop) for r in layers]} do not tile the model in order")
    if not infos[-1].last_stage:
        raise ConfigError("the last listed stage does not own the LM head")
    return ModelInfo(fingerprint=first.model, chunk_size=first.chunk_size, vocab_size=first.vocab_size,
                     max_tokens=min(info.max_tokens for info in infos), stage_layers=layers, kv_heads=first.kv_heads)
