"""The coordinator's HTTP API (FastAPI).

* `POST /v1/completions`, `POST /v1/chat/completions`: OpenAI-compatible, streaming (SSE) or not.
* `POST /v1/restore`: restore a prefix on the stage workers and hold it; `GET /v1/restore/{id}`
  (`?wait=s` blocks until it finishes); `DELETE /v1/restore/{id}`: cancel it or free its KV.
* `GET /v1/models`, `GET /v1/cluster` (workers' and pods' health), `/healthz`, `/readyz`, `/metrics`.

Every `/v1` call needs `Authorization: Bearer <token>`; the token names the tenant. Errors carry
their reason in OpenAI's envelope (`errors.py`): 400 bad input (or a field this server does not
implement), 401 no or wrong token, 403 the storage pods refuse the tenant, 404 unknown model, restore or
URL, 413 a body over `max_body_bytes`, 429 queue full, 502 a stage worker failed (naming it), 503 a stage
is down. Request counts are labelled by the route's template (`/v1/restore/{restore_id}`, `unmatched`
for none), never by the path, so no client can grow /metrics. Everything is checked
before a request takes its place in the queue (the bearer token before any of the body is read); a
completion whose client goes away, streamed or not, is stopped at once (`streaming.py`) and counted
with status 499. `/readyz` answers 503 while a stage is down, a stage's KV pool is full, or no batch slot
can be expected to free up.
"""

# No `from __future__ import annotations`: FastAPI must see the real types of the route parameters.
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import anyio.to_thread
from fastapi import Depends, FastAPI, HTTPException
from fastapi import Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match
from starlette.types import Scope

from cacheflow_common.auth import tenant_of_token
from cacheflow_common.errors import BadRequestError
from cacheflow_services.coordinator.completion import Completion
from cacheflow_services.coordinator.errors import (
    BODY_TOO_LARGE,
    KINDS,
    UNAUTHENTICATED,
    ErrorKind,
    UnknownModelError,
    field_kind,
    http_kind,
    kind_of,
)
from cacheflow_services.coordinator.first_token import Plan
from cacheflow_services.coordinator.metrics import ROUTES, UNMATCHED
from cacheflow_services.coordinator.openai_api import (
    ChatBody,
    CompletionBody,
    Output,
    RestoreBody,
    SamplingBody,
    StreamHead,
    now,
    response,
    sse,
    stop_strings,
)
from cacheflow_services.coordinator.request import Request
from cacheflow_services.coordinator.service import Coordinator
from cacheflow_services.coordinator.streaming import CompletionStream, Departure, while_connected
from cacheflow_services.coordinator.tokenizer import TextCodec
from cacheflow_services.http_limits import UNAUTHORIZED, BearerFirst, BodyLimit, BodyTooLargeError

CLIENT_LEFT = "499"  # the status counted for a request whose client went away before its answer (as nginx does)


def create_app(coordinator: Coordinator, codec: TextCodec | None, *, threads: int = 0) -> FastAPI:
    """The API; `threads` > 0 sizes the pool that runs the (blocking) handlers."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if threads > 0:
            anyio.to_thread.current_default_thread_limiter().total_tokens = threads
        yield

    app = FastAPI(title="CacheFlow coordinator", docs_url=None, redoc_url=None, lifespan=lifespan)
    config, metrics = coordinator.config, coordinator.metrics

    def error(scope: Scope, kind: ErrorKind, message: str, param: str | None = None) -> JSONResponse:
        """The answer to a refused or failed request, counted under its route's template."""
        metrics.requests.labels(route_label(app.router.routes, scope), str(kind.status)).inc()
        return error_response(kind, message, param)

    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    # added last, so outermost: no token is a 401 before a byte of the body is read (not a 400 or 413)
    app.add_middleware(BearerFirst, authenticate=lambda token: tenant_of_token(config.api_tokens, token),
                       needs_token=lambda path: path.startswith("/v1/"),
                       refuse=lambda scope: error(scope, UNAUTHENTICATED, UNAUTHORIZED))

    async def raised(request: HttpRequest, exc: Exception) -> JSONResponse:
        return error(request.scope, kind_of(exc), str(exc))

    for exc_type in [*KINDS, Exception]:  # Exception: a bug, still answered in the envelope (500)
        app.add_exception_handler(exc_type, raised)

    @app.exception_handler(BodyTooLargeError)
    async def too_large(request: HttpRequest, exc: BodyTooLargeError) -> JSONResponse:
        return error(request.scope, BODY_TOO_LARGE, exc.detail)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        """What Starlette refuses itself: no such URL (404), a method the route lacks (405)."""
        message = f"no route for {request.method} {request.url.path}" if exc.status_code == 404 else exc.detail
        answer = error(request.scope, http_kind(exc.status_code), message)
        answer.headers.update(exc.headers or {})  # a 405's Allow
        return answer

    @app.exception_handler(RequestValidationError)
    async def invalid(request: HttpRequest, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        message = f"{where}: {first['msg']}" if where else first["msg"]
        param = None if first["type"] == "json_invalid" else where or first.get("ctx", {}).get("name")
        return error(request.scope, field_kind(first["type"]), message, param)

    def tenant(request: HttpRequest) -> str:
        found = getattr(request.state, "tenant", None)  # set by BearerFirst on every /v1 path
        if not isinstance(found, str):
            raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
        return found

    def check_model(name: str) -> None:
        if name != config.model_name:
            raise UnknownModelError(f"model {name!r} is not served here; this cluster serves {config.model_name!r}")

    def encode(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if codec is None:
            raise BadRequestError("this model has no tokenizer: send the prompt as a list of token ids")
        codec.check_length(len(prompt), coordinator.model.max_tokens)  # before tokenizing it
        return codec.encode(prompt)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """Ready: every stage answers with room in its KV pool, and a batch slot can be expected to free up."""
        status = coordinator.cluster.status()
        stuck = coordinator.stuck()
        slots = {"held": coordinator.admission.running, "max": config.max_batch,
                 "oldest_age_s": round(coordinator.admission.oldest_slot_age_s(), 3), "stuck": stuck}
        ready = all(s["up"] and not s["pool_full"] for s in status["stages"]) and not stuck
        return JSONResponse({"ready": ready, "slots": slots, **status}, status_code=200 if ready else 503)

    @app.get("/v1/models")
    def models(_: Annotated[str, Depends(tenant)]) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "owned_by": "cacheflow",
                                            "max_model_len": coordinator.model.max_tokens}]}

    @app.get("/v1/cluster")
    def cluster(_: Annotated[str, Depends(tenant)]) -> dict[str, Any]:
        status = coordinator.cluster.status()
        for stage in status["stages"]:  # each stage's restores so far, by mode (token | layer)
            stage["restore_modes"] = metrics.restore_modes(stage["stage"])
        return {**status, "policy": config.policy, "waiting": coordinator.admission.waiting,
                "running": coordinator.admission.running}

    @app.post(ROUTES["completions"], response_model=None)
    async def completions(body: CompletionBody, who: Annotated[str, Depends(tenant)],
                          http: HttpRequest) -> Response | dict[str, Any]:
        return await while_connected(http.receive, lambda departure: text_completion(body, who, departure))

    def text_completion(body: CompletionBody, who: str, departure: Departure) -> Response | dict[str, Any]:
        check_model(body.model)
        return generate("text", encode(body.prompt), who, body, body.max_tokens, departure)

    @app.post(ROUTES["chat"], response_model=None)
    async def chat(body: ChatBody, who: Annotated[str, Depends(tenant)],
                   http: HttpRequest) -> Response | dict[str, Any]:
        return await while_connected(http.receive, lambda departure: chat_completion(body, who, departure))

    def chat_completion(body: ChatBody, who: str, departure: Departure) -> Response | dict[str, Any]:
        check_model(body.model)
        if codec is None:
            raise BadRequestError("this model has no tokenizer or chat template: use /v1/completions with token ids")
        prompt = codec.chat([m.model_dump() for m in body.messages], coordinator.model.max_tokens)
        return generate("chat", prompt, who, body, body.new_tokens(), departure)

    def generate(kind: str, prompt: list[int], who: str, body: SamplingBody, max_new: int,
                 departure: Departure) -> Response | dict[str, Any]:
        """Admit, then answer (streamed or whole); a client that goes away meanwhile stops the completion."""
        coordinator.checks.prompt(prompt, max_new)
        coordinator.checks.stop_ids(body.stop_token_ids)
        stops = stop_strings(body.stop)
        if stops and codec is None:
            raise BadRequestError("stop strings need a tokenizer; use stop_token_ids")
        stop_ids = frozenset(body.stop_token_ids) | (codec.eos_ids if codec and not body.ignore_eos else frozenset())
        request = coordinator.intake.admit(prompt, who, prefix_limit=len(prompt) - 1, kind="cmpl",
                                           policy=body.policy or config.policy, gone=lambda: departure.gone)
        tokens = coordinator.complete(request, Plan(max_new_tokens=max_new, temperature=body.temperature,
                                                    seed=body.seed, stop_ids=stop_ids, save=body.save))
        departure.on_leave(tokens.abort, request.id)  # gone already: stopped now, the queue place freed
        try:
            return answer(kind, request, tokens, body, stops, stop_ids, len(prompt), departure)
        except BaseException as exc:
            tokens.abort()  # whatever went wrong, the request holds no slot and no KV
            if departure.gone and isinstance(exc, Exception):  # what failed was the stopping: nobody to tell
                metrics.requests.labels(_route_of(kind), CLIENT_LEFT).inc()
                return Response(status_code=int(CLIENT_LEFT))
            raise

    def answer(kind: str, request: Request, tokens: Completion, body: SamplingBody, stops: list[str],
               stop_ids: frozenset[int], prompt_tokens: int, departure: Departure) -> Response | dict[str, Any]:
        deltas = _decoded(tokens, codec, stops, stop_ids, request.arrived)
        created = now()
        endpoint = _route_of(kind)
        if body.stream:
            metrics.requests.labels(endpoint, "200").inc()
            head = StreamHead(kind, request.id, body.model, created, prompt_tokens, body.stream_options)
            events = sse(head, deltas, lambda output: _extra(request, output))
            return CompletionStream(events, stop=tokens.abort, request_id=request.id)
        output = deque(deltas, maxlen=1)[0][1]  # the last (finished) output
        metrics.requests.labels(endpoint, CLIENT_LEFT if departure.gone else "200").inc()
        return response(kind, request.id, body.model, created, output, prompt_tokens, _extra(request, output))

    @app.post(ROUTES["restore"])
    def restore(body: RestoreBody, who: Annotated[str, Depends(tenant)]) -> dict[str, Any]:
        if (body.token_ids is None) == (body.prompt is None):
            raise BadRequestError("give the prefix as exactly one of token_ids or prompt")
        prefix = encode(body.prompt if body.prompt is not None else body.token_ids or [])
        coordinator.checks.prompt(prefix, 1)
        request = coordinator.intake.admit(prefix, who, prefix_limit=len(prefix), policy=body.policy or config.policy,
                                           kind="rst")
        metrics.requests.labels(ROUTES["restore"], "200").inc()
        return coordinator.restores.start(request).view()

    @app.get("/v1/restore/{restore_id}")
    def restore_status(restore_id: str, who: Annotated[str, Depends(tenant)], wait: float = 0.0) -> dict[str, Any]:
        record = coordinator.restores.record(restore_id, who)
        record.done.wait(min(max(wait, 0.0), 600.0))
        return record.view()

    @app.delete("/v1/restore/{restore_id}")
    def restore_cancel(restore_id: str, who: Annotated[str, Depends(tenant)]) -> dict[str, Any]:
        return coordinator.restores.cancel(restore_id, who).view()

    @app.get("/metrics")
    def prometheus() -> Response:
        status = coordinator.cluster.status()
        for s in status["stages"]:
            metrics.stage_up.labels(str(s["stage"])).set(int(s["up"]))
        for p in status["pods"]:
            metrics.pod_up.labels(p["pod"]).set(int(p["up"]))
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _decoded(tokens: Completion, codec: TextCodec | None, stops: list[str], stop_ids: frozenset[int],
             arrived: float) -> Iterator[tuple[str, Output, bool]]:
    """(new text, output so far, finished) per token; stops at a stop token or string (not included)."""
    output = Output()
    try:
        for token in tokens:
            output.ttft_s = output.ttft_s or time.perf_counter() - arrived
            if token in stop_ids:
                output.finish_reason = "stop"
                break
            output.token_ids.append(token)
            text = codec.decode(output.token_ids) if codec is not None else ""
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            delta = (text[:cut] if cut >= 0 else text)[len(output.text) :]
            output.text += delta
            if cut >= 0:
                output.finish_reason = "stop"
                yield delta, output, True
                return
            yield delta, output, False
    finally:
        tokens.close()  # frees the request's KV on the workers at once
    yield "", output, True


def _extra(request: Request, output: Output) -> dict[str, Any]:
    """The response's `cacheflow` object: timings, the policy used and each stage's restore mode."""
    return {"ttft_s": output.ttft_s, "prompt_tokens_restored": request.cached_tokens, "policy": request.policy,
            "stage_modes": [s.mode for s in request.stages], "batch": request.ticket.batch,
            "lookup_s": request.lookup_s, "queue_s": request.queue_s, "restore_s": request.restore_s,
            "stages": [s.model_dump() for s in request.stages]}


def _route_of(kind: str) -> str:
    """The route label of a completion of `kind` ("chat" or "text")."""
    return ROUTES["chat" if kind == "chat" else "completions"]


def route_label(routes: list[BaseRoute], scope: Scope) -> str:
    """The request metrics' route label: the template of the route a request matches (`/v1/restore/{restore_id}`),
    or "unmatched"; a fixed set, whatever paths clients send."""
    return next((getattr(r, "path", UNMATCHED) for r in routes if r.matches(scope)[0] != Match.NONE), UNMATCHED)


def error_response(kind: ErrorKind, message: str, param: str | None = None) -> JSONResponse:
    """`kind`'s status with OpenAI's error body; Retry-After on 429 and 503, the scheme to use on 401."""
    headers = {"Retry-After": "1"} if kind.status in (429, 503) else {}
    if kind.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(kind.body(message, param), status_code=kind.status, headers=headers)
