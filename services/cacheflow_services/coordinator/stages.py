"""The coordinator's client of the stage workers: restore on every stage at once, then generate.

This is what the coordinator does for one request (and what tests and benchmarks use directly), in the
typed messages of `cacheflow_common.stage_api`:

1. `restore`: `POST /v1/restore` to every stage concurrently; each stage's engine batches it with the
   other requests restoring there and answers once its pointers have met. With `input="auto"` it asks
   for the boundary-activation restore and, if any stage lacks its boundary activations, releases and
   restores pipelined instead. The calls of every request in flight share one event loop (one thread),
   not a thread per stage per request.
2. `generate` / `stream`: the suffix goes to stage 0, which forwards hidden states stage to stage; the
   last stage answers with the next token (TTFT); then one token at a time.
3. `release`: every stage frees the request's KV (also done on any failure).

Every call carries the cluster's internal token, and every request's work a grant the coordinator
signs for that request and tenant (`cacheflow_common.auth.GrantIssuer`): without them a worker refuses.

A stage that dies or fails makes the call raise `ChainError` naming the stage and the reason (a
stage that failed behind the one called, e.g. stage 1 while stage 0 forwarded to it, is named as
itself, from the relaying stage's answer); the time that takes is bounded by the HTTP timeout (and,
pipelined, by the workers' upstream timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from cacheflow_common.auth import GrantIssuer
from cacheflow_common.errors import CacheFlowError
from cacheflow_common.restore.stages import BoundaryMissingError
from cacheflow_common.stage_api import (
    ForwardAnswer,
    ForwardMeta,
    RestoreRequest,
    RestoreSummary,
    StageError,
    WorkerInfo,
)
from cacheflow_common.transport import frames


class ChainError(CacheFlowError):
    """Stage `stage` failed (`error`: its error type, e.g. "BoundaryMissingError") or could not be
    reached (`unreachable`), whichever stage the coordinator called; `status`: the HTTP status of the
    answer the coordinator got (0 when it got none)."""

    def __init__(self, stage: int, message: str, *, status: int = 0, error: str = "",
                 unreachable: bool = False) -> None:
        super().__init__(f"stage {stage}: {message}")
        self.stage = stage
        self.status = status
        self.error = error
        self.unreachable = unreachable

    @property
    def boundaries_missing(self) -> bool:
        """The stage lacks its boundary activations: it can restore pipelined instead."""
        return self.error == BoundaryMissingError.__name__


@dataclass
class Generation:
    tokens: list[int]
    ttft_s: float  # suffix sent -> first token back
    total_s: float
    restore: list[RestoreSummary] = field(default_factory=list)  # per stage, when the prefix was restored


class StageChain:
    """The stage workers of one pipeline, shared by up to `max_requests` requests in flight at once."""

    def __init__(self, urls: Sequence[str], *, issuer: GrantIssuer, timeout_s: float = 120.0,
                 max_requests: int = 64) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.issuer = issuer
        calls = max(1, len(self.urls)) * max(1, max_requests)  # every request's restore on every stage at once
        self.timeout_s = timeout_s
        self._limits = httpx.Limits(max_connections=calls, max_keepalive_connections=calls)
        self._http = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=max(1, max_requests) * 2),
                                  headers=issuer.headers)
        self._loop = asyncio.new_event_loop()
        self._async_http: httpx.AsyncClient | None = None
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="stage-calls", daemon=True)
        self._loop_thread.start()

    # ------------------------------------------------------------------------------------ restore
    def restore(self, request_id: str, token_ids: Sequence[int], *, tenant: str, input: str = "auto",
                reserve_tokens: int = 0, policy: str = "", arrived: float | None = None,
                save: bool = True) -> list[RestoreSummary]:
        """Restore the prefix on every stage at once; per-stage summaries in stage order. `arrived`: when the
        request arrived (perf_counter), so the stages know how long it has waited; `save`: whether the
        stages may store what they recompute (the request's grant says so)."""
        if input == "auto":
            try:
                return self.restore(request_id, token_ids, tenant=tenant, input="boundary",
                                    reserve_tokens=reserve_tokens, policy=policy, arrived=arrived, save=save)
            except ChainError as exc:
                if not exc.boundaries_missing:
                    raise
            input = "pipelined"
        waited = 0.0 if arrived is None else max(0.0, time.perf_counter() - arrived)
        grant = self.issuer.issue(request_id, tenant, save=save, max_tokens=len(token_ids) + reserve_tokens)
        body = RestoreRequest.model_validate({"request_id": request_id, "tenant": tenant, "token_ids": list(token_ids),
                                              "input": input, "reserve_tokens": reserve_tokens, "policy": policy,
                                              "waited_s": waited, "grant": grant})
        outcomes = asyncio.run_coroutine_threadsafe(self._restore_all(body), self._loop).result()
        errors = [o for o in outcomes if isinstance(o, ChainError)]
        if errors:  # every stage answered (each bounded by the timeout), so none is left holding KV
            self.release(request_id)
            raise min(errors, key=_root_cause_first)
        return [o for o in outcomes if isinstance(o, RestoreSummary)]

    async def _restore_all(self, body: RestoreRequest) -> list[RestoreSummary | ChainError]:
        if self._async_http is None:  # created on the loop it serves
            self._async_http = httpx.AsyncClient(timeout=self.timeout_s, limits=self._limits,
                                                 headers=self.issuer.headers)
        http = self._async_http

        async def one(stage: int) -> RestoreSummary | ChainError:
            try:
                response = await http.post(self.urls[stage] + "/v1/restore", json=body.model_dump())
            except httpx.HTTPError as exc:
                return ChainError(stage, f"unreachable ({type(exc).__name__}: {exc})", unreachable=True)
            try:
                return RestoreSummary.model_validate(_answer(stage, response))
            except ChainError as exc:
                return exc

        return list(await asyncio.gather(*(one(s) for s in range(len(self.urls)))))

    # ------------------------------------------------------------------------------------ generate
    def generate(self, request_id: str, new_token_ids: Sequence[int], *, start: int, tenant: str,
                 max_new_tokens: int, temperature: float = 0.0, seed: int = 0, save: bool = True,
                 reserve_tokens: int = 0) -> Generation:
        """Prefill `new_token_ids` at position `start` (after a restored prefix, or 0), then decode."""
        began = time.perf_counter()
        tokens: list[int] = []
        ttft = 0.0
        for token in self.stream(request_id, new_token_ids, start=start, tenant=tenant, max_new_tokens=max_new_tokens,
                                 temperature=temperature, seed=seed, save=save, reserve_tokens=reserve_tokens):
            tokens.append(token)
            ttft = ttft or time.perf_counter() - began
        return Generation(tokens=tokens, ttft_s=ttft, total_s=time.perf_counter() - began)

    def stream(self, request_id: str, new_token_ids: Sequence[int], *, start: int, tenant: str,
               max_new_tokens: int, temperature: float = 0.0, seed: int = 0, save: bool = True,
               reserve_tokens: int = 0, stop_ids: frozenset[int] = frozenset()) -> Iterator[int]:
        """`generate`, one token at a time as each comes back; ends early after a token in `stop_ids`."""
        reserve = reserve_tokens or len(new_token_ids) + max_new_tokens
        meta = {"request_id": request_id, "tenant": tenant, "temperature": temperature, "seed": seed, "save": save,
                "reserve_tokens": reserve}
        held = start + len(new_token_ids) + reserve  # the most a stage may allocate for it (granted)
        token = self._forward(meta, start, list(new_token_ids), held)
        position = start + len(new_token_ids)
        for produced in range(1, max_new_tokens + 1):
            yield token
            if produced == max_new_tokens or token in stop_ids:
                return
            token = self._forward(meta, position, [token], held)
            position += 1

    def _forward(self, meta: dict[str, Any], start: int, token_ids: list[int], held: int) -> int:
        grant = self.issuer.issue(meta["request_id"], meta["tenant"], save=meta["save"], max_tokens=held)
        forward = ForwardMeta.model_validate({**meta, "start": start, "token_ids": token_ids, "grant": grant})
        result = self._call(0, "POST", "/v1/forward", content=frames.pack(forward.model_dump()),
                            headers={"Content-Type": frames.CONTENT_TYPE})
        return ForwardAnswer.model_validate(result).token

    # ------------------------------------------------------------------------------------ release
    def release(self, request_id: str) -> None:
        """Free the request on every stage; stages that cannot be reached are skipped (they lost it anyway)."""
        for stage in range(len(self.urls)):
            with contextlib.suppress(ChainError):
                self._call(stage, "DELETE", f"/v1/requests/{request_id}")

    def info(self) -> list[WorkerInfo]:
        return [WorkerInfo.model_validate(self._call(s, "GET", "/v1/info")) for s in range(len(self.urls))]

    def close(self) -> None:
        self._http.close()
        if self._async_http is not None:
            asyncio.run_coroutine_threadsafe(self._async_http.aclose(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)

    def _call(self, stage: int, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._http.request(method, self.urls[stage] + path, **kwargs)
        except httpx.HTTPError as exc:
            raise ChainError(stage, f"unreachable ({type(exc).__name__}: {exc})", unreachable=True) from exc
        return _answer(stage, response)


def _answer(stage: int, response: httpx.Response) -> dict[str, Any]:
    """The JSON body of a stage's answer; ChainError naming the stage that failed (the one called, or one
    further down that it relays) for a 4xx or 5xx."""
    if response.status_code >= 400:
        failed = StageError.of_response(response.status_code, response.content)
        raise ChainError(stage + failed.hops, failed.detail, status=response.status_code, error=failed.error,
                         unreachable=failed.unreachable)
    result: dict[str, Any] = response.json()
    return result


def _root_cause_first(error: ChainError) -> tuple[int, int]:
    """Among several stage failures, report an unreachable stage first (the others follow from it)."""
    return (0 if error.unreachable else 1, error.stage)
