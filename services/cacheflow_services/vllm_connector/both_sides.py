"""What both sides of the connector use: the storage pods, the stats file, and the blocks a load covers.
Kept apart from `worker.py` so that vLLM's scheduler process, which plans loads and saves but never restores,
does not load the restore engine (2.4 MiB of resident memory, measured beside vLLM and torch).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from cacheflow_common.store.placement import ClusterStore
from cacheflow_common.transport.pod_client import PodAddress, PodClient
from cacheflow_services.vllm_connector.config import ConnectorConfig
from cacheflow_services.vllm_connector.plan import LoadSpec


def open_store(cfg: ConnectorConfig) -> ClusterStore:
    """Placement over the pods, authenticated as the tenant."""
    token = cfg.token()
    pods = {a.pod_id: PodClient(a, token, timeout_s=cfg.timeout_s) for a in map(PodAddress.parse, cfg.pods)}
    return ClusterStore(pods, replicas=cfg.replicas)  # type: ignore[arg-type]


class StatsLog:
    """One JSON line per event, appended to a file (nothing without a path); totals kept in memory."""

    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None
        self.totals: dict[str, int] = {}
        self._lock = threading.Lock()

    def event(self, kind: str, **fields: Any) -> None:
        with self._lock:
            self.totals[kind] = self.totals.get(kind, 0) + 1
            if self.path is not None:
                with self.path.open("a") as f:
                    f.write(json.dumps({"event": kind, "time": time.time(), **fields}) + "\n")


def blocks_from(spec: LoadSpec, first: int, block_size: int) -> set[int]:
    """The block ids holding positions [first, N) of the spec's prefix."""
    last = -(-len(spec.token_ids) // block_size)
    return set(spec.block_ids[first // block_size : last])
