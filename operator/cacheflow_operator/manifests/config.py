"""The ConfigMap with the cluster spec: the same spec as `cacheflow up --spec` takes, and the resolved layout.

`kubectl get configmap <name>-spec -o jsonpath='{.data.cluster\\.yaml}' > c.yaml && cacheflow up --spec c.yaml`
runs the same cluster (model, stages, pods, batching) as local processes.
"""

from __future__ import annotations

from typing import Any

import yaml

from cacheflow_operator.manifests.common import config_name, coordinator_url, metadata, pod_addresses, stage_urls
from cacheflow_operator.spec import Cluster

COMPONENT = "config"


def local_spec(c: Cluster) -> dict[str, Any]:
    """The resource's spec in the keys of `cacheflow up`'s cluster spec (services/local_cluster.py)."""
    s = c.spec
    return {"model": s.model.source, "dtype": s.model.dtype, "stages": s.stages.count, "pods": s.storage.pods,
            "chunk_size": s.stages.chunk_size, "policy": s.stages.policy, "backend": s.storage.backend,
            "redis_url": s.storage.redis_url, "rate_gbps": s.storage.link_rate_gbps,
            "link_capacity_gbps": s.storage.link_capacity_gbps,
            "transport": s.storage.transport, "max_batch": s.coordinator.batching.max_batch,
            "max_queue": s.coordinator.batching.max_queue, "batch_window_ms": s.coordinator.batching.window_ms}


def layout(c: Cluster) -> dict[str, Any]:
    return {"endpoint": coordinator_url(c),
            "stages": [{"stage": i, "layers": f"{r.start}:{r.stop}", "url": url}
                       for i, (r, url) in enumerate(zip(c.spec.split(), stage_urls(c), strict=True))],
            "storage_pods": pod_addresses(c)}


def _yaml(data: dict[str, Any]) -> str:
    return yaml.safe_dump(data, sort_keys=False)


def config_map(c: Cluster) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(c, config_name(c), COMPONENT),
            "data": {"cluster.yaml": _yaml(local_spec(c)), "layout.yaml": _yaml(layout(c))}}
