"""The coordinator's client of the stage workers: restore on every stage at once, then generate.

This is what the coordinator does for one request (and what tests and benchmarks use directly), in the
typed messages of `cacheflow_common.stage_api`:

1. `restore`: `POST /v1/restore` to every stage concurrently; each stage's engine batches it with the
   other requests restoring there and answers once its pointers have met. With `input="auto"` it climbs
   `ladder.RESTORE_LADDER`: the boundary-activation restore, pipelined where a stage lacks its boundary
   activations. The calls of every request in flight share one event loop (one thread), not a thread
   per stage per request.
2. `prefill`: the suffix goes to stage 0, which forwards hidden states stage to stage; the last stage
   answers with the next token (TTFT). `decode`: then one token at a time (`stream`/`generate`: both).
3. `release`: every stage frees the request's KV (also done on any failure).

Every call carries the cluster's internal token and a grant the coordinator signs for just that call
(`cacheflow_common.auth.GrantIssuer`: its operation, the stages it reaches, the request, tenant and a
digest of its tokens, good once): without them a worker refuses. A restore's call to stage s also
brings a delivery grant for stage s+1, which its pipelined deliveries carry. A call whose connection
went stale (not its stage) is sent once more, with a fresh grant, before anything is given up.

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

from cacheflow_common.auth import GRANT_HEADER, GrantIssuer, input_digest
from cacheflow_common.stage_api import ForwardAnswer, ForwardMeta, InputMode, RestoreRequest, RestoreSummary, WorkerInfo
from cacheflow_common.tls import TLSFiles
from cacheflow_common.transport import frames
from cacheflow_services.coordinator.chain_error import ChainError, checked, root_cause_first
from cacheflow_services.coordinator.ladder import RESTORE_LADDER, Rung, climb, input_mode
from cacheflow_services.http_server import (
    aretry_on_stale_connection,
    async_http_client,
    http_client,
    retry_on_stale_connection,
)

__all__ = ["ChainError", "Generation", "Sampling", "StageChain"]


@dataclass
class Generation:
    tokens: list[int]
    ttft_s: float  # suffix sent -> first token back
    total_s: float
    restore: list[RestoreSummary] = field(default_factory=list)  # per stage, when the prefix was restored


@dataclass(frozen=True)
class Sampling:
    """What every forward of one request repeats: whose it is, how its tokens are sampled, what it may hold."""

    request_id: str
    tenant: str
    held: int  # the most a stage may allocate for it (its grant says so)
    reserve_tokens: int
    temperature: float = 0.0
    seed: int = 0
    save: bool = True

    @classmethod
    def of(cls, request_id: str, tenant: str, *, start: int, new_tokens: int, max_new_tokens: int,
           reserve_tokens: int = 0, temperature: float = 0.0, seed: int = 0, save: bool = True) -> Sampling:
        """The forwards' settings of a request prefilling `new_tokens` at `start`; `reserve_tokens` (0: the
        new tokens and those to generate) is the room each stage keeps for it."""
        reserve = reserve_tokens or new_tokens + max_new_tokens
        return cls(request_id=request_id, tenant=tenant, held=start + new_tokens + reserve, reserve_tokens=reserve,
                   temperature=temperature, seed=seed, save=save)


class StageChain:
    """The stage workers of one pipeline, shared by up to `max_requests` requests in flight at once."""

    def __init__(self, urls: Sequence[str], *, issuer: GrantIssuer, timeout_s: float = 120.0,
                 max_requests: int = 64, tls: TLSFiles | None = None) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.issuer = issuer
        self.tls = tls
        calls = max(1, len(self.urls)) * max(1, max_requests)  # every request's restore on every stage at once
        self.timeout_s = timeout_s
        self._limits = httpx.Limits(max_connections=calls, max_keepalive_connections=calls)
        self._http = http_client(timeout=timeout_s, limits=httpx.Limits(max_connections=max(1, max_requests) * 2),
                                  headers=issuer.headers, tls=tls)
        self._loop = asyncio.new_event_loop()
        self._async_http: httpx.AsyncClient | None = None
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="stage-calls", daemon=True)
        self._loop_thread.start()

    # ------------------------------------------------------------------------------------ restore
    def restore(self, request_id: str, token_ids: Sequence[int], *, tenant: str, input: str = "auto",
                reserve_tokens: int = 0, policy: str = "", arrived: float | None = None,
                save: bool = True) -> list[RestoreSummary]:
        """Restore the prefix on every stage at once; per-stage summaries in stage order. `input`: a stage
        input mode, or "auto" (`RESTORE_LADDER`); `arrived`: when the request arrived (perf_counter), so
        the stages know how long it has waited; `save`: whether the stages may store what they recompute
        (the request's grant says so)."""
        ladder = RESTORE_LADDER if input == "auto" else (Rung(input_mode(input)),)
        return climb(ladder, lambda rung: [] if rung.input is None else self.restore_as(
            rung.input, request_id, token_ids, tenant=tenant, reserve_tokens=reserve_tokens, policy=policy,
            arrived=arrived, save=save))

    def restore_as(self, input: InputMode, request_id: str, token_ids: Sequence[int], *, tenant: str,
                   reserve_tokens: int, policy: str, arrived: float | None, save: bool) -> list[RestoreSummary]:
        """`restore` in one input mode, no fallback; on a failure every stage has dropped the request."""
        waited = 0.0 if arrived is None else max(0.0, time.perf_counter() - arrived)
        body = RestoreRequest(request_id=request_id, tenant=tenant, token_ids=list(token_ids), input=input,
                              reserve_tokens=reserve_tokens, policy=policy, waited_s=waited)
        outcomes = asyncio.run_coroutine_threadsafe(self._restore_all(body, save), self._loop).result()
        errors = [o for o in outcomes if isinstance(o, ChainError)]
        if errors:  # every stage answered (each bounded by the timeout), so none is left holding KV
            self.release(request_id, tenant)
            raise min(errors, key=root_cause_first)
        return [o for o in outcomes if isinstance(o, RestoreSummary)]

    def _restore_grant(self, op: str, stage: int, body: RestoreRequest, save: bool) -> str:
        return self.issuer.issue(op, stages=[stage], request_id=body.request_id, tenant=body.tenant,
                                 digest=input_digest(body.token_ids, reserve=body.reserve_tokens), save=save,
                                 max_tokens=len(body.token_ids) + body.reserve_tokens)

    async def _restore_all(self, body: RestoreRequest, save: bool) -> list[RestoreSummary | ChainError]:
        if self._async_http is None:  # created on the loop it serves
            self._async_http = async_http_client(timeout=self.timeout_s, limits=self._limits,
                                                 headers=self.issuer.headers, tls=self.tls)
        http = self._async_http

        async def send(stage: int) -> httpx.Response:
            feeds = stage + 1 < len(self.urls) and body.input != "boundary"
            deliver = self._restore_grant("deliver", stage + 1, body, save) if feeds else ""
            return await http.post(self.urls[stage] + "/v1/restore",
                                   json=body.model_copy(update={"deliver_grant": deliver}).model_dump(),
                                   headers={GRANT_HEADER: self._restore_grant("restore", stage, body, save)})

        async def one(stage: int) -> RestoreSummary | ChainError:
            try:
                response = await aretry_on_stale_connection(lambda: send(stage))
            except httpx.HTTPError as exc:
                return ChainError.not_reached(stage, exc)
            try:
                return RestoreSummary.model_validate_json(checked(stage, response).content)
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
        sampling = Sampling.of(request_id, tenant, start=start, new_tokens=len(new_token_ids),
                               max_new_tokens=max_new_tokens, reserve_tokens=reserve_tokens,
                               temperature=temperature, seed=seed, save=save)
        first = self.prefill(sampling, new_token_ids, start=start)
        yield first
        yield from self.decode(sampling, first, position=start + len(new_token_ids), max_new_tokens=max_new_tokens,
                               stop_ids=stop_ids)

    def prefill(self, sampling: Sampling, new_token_ids: Sequence[int], *, start: int) -> int:
        """Forward the prompt's tokens from `start` through every stage: the first new token."""
        return self._forward(sampling, start, list(new_token_ids))

    def decode(self, sampling: Sampling, token: int, *, position: int, max_new_tokens: int,
               stop_ids: frozenset[int] = frozenset()) -> Iterator[int]:
        """The tokens after `token` (the prefill's, at `position`), one forward each, until there are
        `max_new_tokens` with it or one is in `stop_ids`."""
        for _ in range(1, max_new_tokens):
            if token in stop_ids:
                return
            token = self._forward(sampling, position, [token])
            position += 1
            yield token

    def _forward(self, sampling: Sampling, start: int, token_ids: list[int]) -> int:
        forward = ForwardMeta(request_id=sampling.request_id, start=start, token_ids=token_ids, tenant=sampling.tenant,
                              reserve_tokens=sampling.reserve_tokens, save=sampling.save,
                              temperature=sampling.temperature, seed=sampling.seed)
        grant = {"stages": range(len(self.urls)), "request_id": sampling.request_id, "tenant": sampling.tenant,
                 "digest": input_digest(token_ids, start=start, reserve=sampling.reserve_tokens),
                 "save": sampling.save, "max_tokens": sampling.held}
        answer = self._call(0, "POST", "/v1/forward", grant=grant, content=frames.pack(forward.model_dump()),
                            headers={"Content-Type": frames.CONTENT_TYPE})
        return ForwardAnswer.model_validate_json(answer.content).token

    # ------------------------------------------------------------------------------------ release
    def release(self, request_id: str, tenant: str) -> None:
        """Free the request on every stage; stages that cannot be reached are skipped (they lost it anyway)."""
        for stage in range(len(self.urls)):
            with contextlib.suppress(ChainError):
                self._call(stage, "DELETE", f"/v1/requests/{request_id}",
                           grant={"stages": [stage], "request_id": request_id, "tenant": tenant})

    def info(self) -> list[WorkerInfo]:
        return [WorkerInfo.model_validate_json(self._call(s, "GET", "/v1/info", grant={"stages": [s]}).content)
                for s in range(len(self.urls))]

    def close(self) -> None:
        self._http.close()
        if self._async_http is not None:
            asyncio.run_coroutine_threadsafe(self._async_http.aclose(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=10)

    def _call(self, stage: int, method: str, path: str, *, grant: dict[str, Any], headers: dict[str, str] | None = None,
              **kwargs: Any) -> httpx.Response:
        """One call to a stage with a grant for it (`GrantIssuer.issue`'s arguments; the operation is the
        route's), a fresh one for the second try on a stale connection."""
        op = {"DELETE": "release", "GET": "info"}.get(method, path.rsplit("/", 1)[-1])

        def send() -> httpx.Response:
            granted = {**(headers or {}), GRANT_HEADER: self.issuer.issue(op, **grant)}
            return self._http.request(method, self.urls[stage] + path, headers=granted, **kwargs)

        try:
            response = retry_on_stale_connection(send)
        except httpx.HTTPError as exc:
            raise ChainError.not_reached(stage, exc) from exc
        return checked(stage, response)
