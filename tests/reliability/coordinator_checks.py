"""What the coordinator's reliability tests share: a small local cluster and a client of it, reading a
metric from a real process, waiting for a condition with a generous bound, and a second coordinator on
a running local cluster."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cacheflow_services.coordinator.launch import LocalCoordinator, launch_coordinator
from cacheflow_services.local_cluster import SECRETS_DIR, ClusterSpec, LocalCluster, start_cluster

WAIT_S = 120.0  # generous: 2 busy cores


def small_cluster(factory: pytest.TempPathFactory, **spec: Any) -> Iterator[LocalCluster]:
    """A local cluster of the tiny model (2 stages, 2 pods, float32, Cake), with `spec`'s settings, stopped after."""
    base = ClusterSpec(model="tiny", stages=2, pods=2, chunk_size=32, dtype="float32", policy="cake", port=0,
                       transport="tcp", max_batch=8, max_queue=8, threads_per_stage=1, batch_window_ms=30)
    started = start_cluster(replace(base, **spec), factory.mktemp("cluster"))
    yield started
    started.stop()


def api_client(local: LocalCluster) -> Iterator[httpx.Client]:
    """An HTTP client of the cluster's coordinator, with its token."""
    with httpx.Client(base_url=local.coordinator.url, headers={"Authorization": f"Bearer {local.token}"},
                      timeout=WAIT_S) as c:
        yield c


def samples(url: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples called `name` in the process's /metrics: (labels, value) each."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [(s.labels, float(s.value)) for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name]


def metric(url: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """The value of sample `name` (with these labels) in the process's /metrics; None when absent."""
    return next((value for found, value in samples(url, name)
                 if all(found.get(k) == v for k, v in (labels or {}).items())), None)


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.2)


def second_coordinator(local: LocalCluster, workdir: Path, *extra: str, pod_token_file: Path | None = None,
                       token_file: Path | None = None) -> LocalCoordinator:
    """Another coordinator on the cluster's workers and pods (its own options and token files)."""
    pods = [f"pod-{i}=127.0.0.1:{p.data_port}" for i, p in enumerate(local.pods)]
    return launch_coordinator(workdir, stages=[w.url for w in local.workers], pods=pods,
                              pod_token_file=pod_token_file or local_file(local, "pod-tokens"),
                              token_file=token_file or local_file(local, "api-tokens"),
                              secrets=local_file(local, SECRETS_DIR), model="tiny", extra=list(extra))


def local_file(local: LocalCluster, name: str) -> Path:
    return local.coordinator.log_path.parent / name


def post(url: str, token: str, path: str, body: dict | None = None, *, content: bytes | None = None,
         headers: Sequence[tuple[str, str]] = (), timeout_s: float = WAIT_S) -> httpx.Response:
    all_headers = {"Authorization": f"Bearer {token}", **dict(headers)}
    if content is not None:
        all_headers.setdefault("Content-Type", "application/json")
        return httpx.post(f"{url}{path}", content=content, headers=all_headers, timeout=timeout_s)
    return httpx.post(f"{url}{path}", json=body, headers=all_headers, timeout=timeout_s)
