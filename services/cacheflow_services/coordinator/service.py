"""What the coordinator does for a request, whatever the API in front of it: the parts, wired together.

A completion: check the prompt (`checks`), look up how much of its prefix the pods hold and take a place
in the queue (`intake`), then its first token (`first_token`: wait for a batch slot, restore that prefix
on every stage at once, each stage's mode by its L_delta, down the fallback ladder of `ladder` as stages
fail; prefill the rest of the prompt: TTFT; free the slot), then the decodes (`Completion`), then free
the KV. The workers store every new whole chunk as it fills, so the next request sharing the prefix
restores it.

A restore (`POST /v1/restore`, `held_restores`): the same up to the restored prefix; the KV stays held on
the workers until it is released (or `held_restore_s` passes), so a client can prepare a prefix before
it needs it.
"""

from __future__ import annotations

from cacheflow_services.coordinator.admission import Admission
from cacheflow_services.coordinator.checks import PromptChecks
from cacheflow_services.coordinator.cluster import Cluster, ModelInfo
from cacheflow_services.coordinator.completion import Completion
from cacheflow_services.coordinator.config import CoordinatorConfig
from cacheflow_services.coordinator.failures import Failures
from cacheflow_services.coordinator.first_token import FirstTokenSequence, Plan
from cacheflow_services.coordinator.held_restores import HeldRestores
from cacheflow_services.coordinator.intake import Intake
from cacheflow_services.coordinator.metrics import CoordinatorMetrics
from cacheflow_services.coordinator.request import Request
from cacheflow_services.coordinator.restoring import PrefixRestore


class Coordinator:
    def __init__(self, config: CoordinatorConfig, cluster: Cluster, model: ModelInfo,
                 metrics: CoordinatorMetrics | None = None) -> None:
        self.config = config
        self.cluster = cluster
        self.model = model
        self.metrics = metrics or CoordinatorMetrics()
        self.admission = Admission(max_batch=config.max_batch, window_s=config.batch_window_s,
                                   max_queue=config.max_queue, on_batch=self.metrics.batch_size.observe)
        self.metrics.watch_admission(lambda: self.admission.waiting, lambda: self.admission.running,
                                     self.admission.oldest_slot_age_s)
        self.metrics.declare(len(cluster.chain.urls), list(cluster.pod_up))  # zeros from start-up
        self.checks = PromptChecks(model, config.max_new_tokens)
        self.intake = Intake(config, cluster, model, self.admission, self.metrics)
        self.failures = Failures(cluster, self.metrics)
        restore = PrefixRestore(cluster, model, self.intake, self.metrics)
        self.first_token = FirstTokenSequence(config, cluster, self.intake, restore, self.metrics)
        self.restores = HeldRestores(config, cluster, self.intake, restore, self.failures)

    def close(self) -> None:
        self.admission.close()
        self.restores.close()

    def stuck(self) -> str:
        """Why no batch slot can be expected to free up ("" when one can): readiness fails meanwhile."""
        return self.admission.stuck(self.config.slot_stuck_s)

    def complete(self, request: Request, plan: Plan) -> Completion:
        """The new tokens, the first once the prefix is restored and the prompt prefilled; `abort` (or
        `close`) it at any point, from any thread, and its slot and KV are freed."""
        return Completion(lambda: self.first_token.run(request, plan), stop=lambda: self.intake.stop(request),
                          finish=lambda failure: self._finish(request, failure))

    def _finish(self, request: Request, failure: BaseException | None) -> None:
        """A completion ended: its failure (if any) counted, its KV freed on every stage."""
        if failure is not None:
            self.failures.record(request, failure)
        self.cluster.chain.release(request.id, request.tenant)
