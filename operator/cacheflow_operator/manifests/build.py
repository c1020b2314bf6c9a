"""Every child object of a CacheFlowCluster, in the order they are applied (what others depend on first).

The internal Secret is not among them: it is created once and never applied again (`apply.ensure_internal_secret`).
"""

from __future__ import annotations

from typing import Any

from cacheflow_operator.manifests import config, coordinator, network, storage, workers
from cacheflow_operator.spec import Cluster


def children(c: Cluster) -> list[dict[str, Any]]:
    """NetworkPolicies (before any pod starts), ConfigMap, storage (Service, StatefulSet), stages (Service,
    Deployment each), coordinator."""
    stages = range(c.spec.stages.count)
    return [
        *network.network_policies(c),
        config.config_map(c),
        storage.headless_service(c),
        storage.statefulset(c),
        *(obj for s in stages for obj in (workers.stage_service(c, s), workers.deployment(c, s))),
        coordinator.api_service(c),
        coordinator.deployment(c),
    ]
