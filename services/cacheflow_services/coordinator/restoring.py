"""Restoring a request's prefix on every stage by a fallback ladder (`ladder.py`), with its timings counted.

Stepping down a rung costs the request time, never its answer: a shorter prefix (or none) leaves more
of the prompt to prefill, which gives the same tokens.
"""

from __future__ import annotations

import time

from cacheflow_services.coordinator.chain_error import ChainError
from cacheflow_services.coordinator.cluster import Cluster, ModelInfo
from cacheflow_services.coordinator.intake import Intake
from cacheflow_services.coordinator.ladder import Ladder, Rung, climb
from cacheflow_services.coordinator.metrics import CoordinatorMetrics
from cacheflow_services.coordinator.request import Request


class PrefixRestore:
    def __init__(self, cluster: Cluster, model: ModelInfo, intake: Intake, metrics: CoordinatorMetrics) -> None:
        self.cluster = cluster
        self.model = model
        self.intake = intake
        self.metrics = metrics

    def climb(self, request: Request, ladder: Ladder, *, room: int | None, save: bool = True) -> None:
        """Restore the request's cached prefix by `ladder`; stepping down may shorten it (or drop it).
        `room`: the tokens to generate, each stage keeping room for them and the rest of the prompt; None:
        a held restore, whose KV is only kept (it keeps no room)."""
        climb(ladder, lambda rung: self._restore(request, rung, room=room, save=save),
              fell=lambda above, below, error: self._fell(request, above, below, error),
              stopped=request.cancelled.is_set)

    def _restore(self, request: Request, rung: Rung, *, room: int | None, save: bool) -> None:
        """Tokens [0, cached) restored on every stage as `rung` says (nothing when none are cached)."""
        if rung.input is None or not request.cached_tokens:
            return
        prefilled = len(request.token_ids) - request.cached_tokens
        began = time.perf_counter()
        request.stages = self.cluster.chain.restore_as(
            rung.input, request.id, request.token_ids[: request.cached_tokens], tenant=request.tenant,
            reserve_tokens=0 if room is None else prefilled + room, policy=request.policy,
            arrived=request.arrived, save=save)
        request.restore_s = time.perf_counter() - began
        request.log.info("restored %d cached tokens in %.3f s; per stage: %s", request.cached_tokens,
                         request.restore_s, ", ".join(f"{s.stage}: {s.policy} {s.mode} ({s.computed} computed, "
                                                      f"{s.loaded} loaded)" for s in request.stages))
        self.metrics.restore_seconds.observe(request.restore_s)
        self.metrics.record_restore(request.stages, request.cached_tokens, [len(r) for r in self.model.stage_layers])

    def _fell(self, request: Request, above: Rung, below: Rung, error: ChainError) -> None:
        """The request steps from `above` (which failed with `error`) to `below`: its prefix as `below` says."""
        if below.input is None:
            keep = 0
        elif below.prefix != above.prefix:
            keep = self.intake.still_stored(request)  # the pods dropped the chunk that failed as they found it
        else:
            request.log.info("restoring %s failed (%s); restoring %s instead", above.input, error, below.input)
            return
        if keep == request.cached_tokens:
            return
        what = f"restoring its first {keep} tokens instead" if keep else "prefilling the whole prompt"
        request.log.warning("restoring its %d cached tokens failed (%s); %s", request.cached_tokens, error, what)
        self.metrics.failures.labels(f"stage{error.stage}:restore-{'shortened' if keep else 'recomputed'}").inc()
        request.cached_tokens, request.stages = keep, []
