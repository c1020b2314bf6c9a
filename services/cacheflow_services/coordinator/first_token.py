"""A completion's way to its first token, as one explicit sequence: wait → restore → prefill → token.

1. wait: for the request's batch slot (`Intake.wait_turn`); a request withdrawn meanwhile ends here.
2. restore: its cached prefix on every stage, down `FIRST_TOKEN_LADDER` as stages fail (`ladder.py`).
3. prefill: the rest of the prompt through the stages; the last stage answers with the first token (TTFT).
4. token: the slot is freed (the decodes that follow hold none) and the first token is counted.

A stage found unreachable in 2 or 3 is no rung of the ladder (every way of restoring needs every stage):
the request waits for it (bounded by `stage_wait_s`) and goes through 2 and 3 once more. Nothing has
reached its client yet, so that costs it time, not its answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from cacheflow_services.coordinator.chain_error import ChainError
from cacheflow_services.coordinator.cluster import Cluster
from cacheflow_services.coordinator.config import CoordinatorConfig
from cacheflow_services.coordinator.intake import Intake
from cacheflow_services.coordinator.ladder import FIRST_TOKEN_LADDER
from cacheflow_services.coordinator.metrics import CoordinatorMetrics
from cacheflow_services.coordinator.request import Request
from cacheflow_services.coordinator.restoring import PrefixRestore
from cacheflow_services.coordinator.stage_chain import Sampling


@dataclass(frozen=True)
class Plan:
    """What the client asked to be generated after its prompt."""

    max_new_tokens: int
    temperature: float
    seed: int
    stop_ids: frozenset[int]
    save: bool = True  # whether the stages may store the chunks this request fills


@dataclass(frozen=True)
class FirstToken:
    token: int
    decodes: Iterator[int]  # the tokens after it, one stage-chain forward each (lazy)


class FirstTokenSequence:
    def __init__(self, config: CoordinatorConfig, cluster: Cluster, intake: Intake, restore: PrefixRestore,
                 metrics: CoordinatorMetrics) -> None:
        self.config = config
        self.cluster = cluster
        self.intake = intake
        self.restore = restore
        self.metrics = metrics

    def run(self, request: Request, plan: Plan) -> FirstToken | None:
        """The first token and the decodes after it; None when the request was stopped before it."""
        try:
            if not self.intake.wait_turn(request):
                return None
            first = self._once_more_if_unreachable(request, lambda: self._restore_and_prefill(request, plan))
        finally:
            self.intake.leave_slot(request)
        if first is not None:
            self._count(request)
        return first

    def _restore_and_prefill(self, request: Request, plan: Plan) -> FirstToken | None:
        self.restore.climb(request, FIRST_TOKEN_LADDER, room=plan.max_new_tokens, save=plan.save)
        if request.cancelled.is_set():
            return None
        prompt, cached = request.token_ids, request.cached_tokens
        sampling = Sampling.of(request.id, request.tenant, start=cached, new_tokens=len(prompt) - cached,
                               max_new_tokens=plan.max_new_tokens, reserve_tokens=len(prompt) + plan.max_new_tokens,
                               temperature=plan.temperature, seed=plan.seed, save=plan.save)
        chain = self.cluster.chain
        token = chain.prefill(sampling, prompt[cached:], start=cached)
        return FirstToken(token, chain.decode(sampling, token, position=len(prompt),
                                              max_new_tokens=plan.max_new_tokens, stop_ids=plan.stop_ids))

    def _once_more_if_unreachable(self, request: Request,
                                  attempt: Callable[[], FirstToken | None]) -> FirstToken | None:
        """`attempt`; if a stage is found unreachable, wait until it is back and `attempt` once more."""
        try:
            return attempt()
        except ChainError as exc:
            if not exc.unreachable or request.cancelled.is_set():
                raise
            request.log.warning("stage %d unreachable before the first token (%s); trying again once it is back",
                                exc.stage, exc)
            self.cluster.mark_stage_down(exc.stage)
            self.cluster.chain.release(request.id, request.tenant)
            self.cluster.wait_for_stages(self.config.stage_wait_s)
        return attempt()

    def _count(self, request: Request) -> None:
        ttft = time.perf_counter() - request.arrived
        self.metrics.ttft.observe(ttft)
        request.log.info("first token: TTFT %.3f s", ttft)
        self.metrics.prefix_tokens.labels("restored").inc(request.cached_tokens)
        self.metrics.prefix_tokens.labels("prefilled").inc(len(request.token_ids) - request.cached_tokens)
