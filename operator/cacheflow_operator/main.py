"""`cacheflow operator`: run the kopf operator that reconciles CacheFlowCluster resources.

The Helm chart runs it as `cacheflow operator --namespace <release namespace>` (a Role is all it needs)
or `--all-namespaces` (a ClusterRole). One replica: peering is off.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import kopf

from cacheflow_common.errors import ConfigError
from cacheflow_operator import handlers  # noqa: F401  (importing it registers the handlers with kopf)

Flag = asyncio.Event | threading.Event  # kopf takes either as its stop and ready flags


async def operator(*, namespaces: Sequence[str], clusterwide: bool, liveness_port: int = 0,
                   stop_flag: Flag | None = None, ready_flag: Flag | None = None) -> None:
    """The operator on this event loop until `stop_flag` (or a signal); the handlers are in `handlers`."""
    if not clusterwide and not namespaces:
        raise ConfigError("the operator needs --namespace NS (repeatable) or --all-namespaces")
    liveness = f"http://0.0.0.0:{liveness_port}/healthz" if liveness_port else None
    await kopf.operator(standalone=True, clusterwide=clusterwide, namespaces=list(namespaces),
                        liveness_endpoint=liveness, stop_flag=stop_flag, ready_flag=ready_flag)


def run(*, namespaces: Sequence[str], clusterwide: bool, liveness_port: int) -> int:
    asyncio.run(operator(namespaces=namespaces, clusterwide=clusterwide, liveness_port=liveness_port))
    return 0
