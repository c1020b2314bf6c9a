"""What a request's failure after admission leaves behind: a counted cause, a log line, a stage marked down."""

from __future__ import annotations

from cacheflow_services.coordinator.chain_error import ChainError
from cacheflow_services.coordinator.cluster import Cluster
from cacheflow_services.coordinator.metrics import CoordinatorMetrics
from cacheflow_services.coordinator.request import Request


class Failures:
    def __init__(self, cluster: Cluster, metrics: CoordinatorMetrics) -> None:
        self.cluster = cluster
        self.metrics = metrics

    def record(self, request: Request, exc: BaseException) -> None:
        """Count `exc` by cause (`stage<s>:<how>` for a stage's), unless the request was stopped: what fails
        then is the stopping. An unreachable stage is marked down, so others are refused until it is back."""
        if request.cancelled.is_set():
            request.log.info("ended after it was stopped: %s", exc)
            return
        cause = type(exc).__name__
        if isinstance(exc, ChainError):
            cause = f"stage{exc.stage}:{'unreachable' if exc.unreachable else exc.error or exc.status}"
            if exc.unreachable:
                self.cluster.mark_stage_down(exc.stage)
        self.metrics.failures.labels(cause).inc()
        request.log.warning("failed (%s): %s", cause, exc)
