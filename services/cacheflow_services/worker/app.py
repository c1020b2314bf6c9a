"""A stage worker's HTTP API (FastAPI): restore, forward, pipelined deliveries, release, health, metrics.

* `POST /v1/restore` (JSON): restore a request's cached prefix on this stage's layers.
* `POST /v1/forward` (tensor frame): run new tokens through this stage and the ones after it; the last
  stage answers with the next token.
* `POST /v1/deliver` (tensor frame): the previous stage's output for one chunk of a pipelined restore.
* `DELETE /v1/requests/{id}`: free the request's KV; `GET /v1/requests/{id}/kv`: read it back.
* `POST /v1/flush`: wait until every queued save is stored.

Every route's credential is declared in `routes.ROUTES`: each `/v1` call needs the cluster's internal
token and the coordinator's grant for its operation on this stage, both checked before any of the body
is read (`routes.RouteGate`); each handler binds the grant to the request, tenant and tokens it names
and spends it (a grant is used once). `/healthz`, `/readyz` and `/metrics` are open (probes, Prometheus).

Errors carry their reason: 400 bad input (non-finite hidden states included), 401 no or wrong internal
token, 403 no valid grant for this call, 404 unknown request or route, 409 state conflict (wrong position,
boundary activations missing: restore pipelined instead), 413 a body over its route's limit, 502 the
next stage failed, 503 pool full.
"""

# No `from __future__ import annotations`: FastAPI must see the real types of the route parameters.
from typing import Any, TypeVar

import anyio
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from cacheflow_common.auth import GRANT_HEADER, Grant, input_digest
from cacheflow_common.engine import PoolFullError, RestoreCancelledError
from cacheflow_common.errors import BadRequestError, GrantError
from cacheflow_common.restore.boundary import BoundaryMissingError
from cacheflow_common.stage_api import (
    BusyTotals,
    DeliverMeta,
    ForwardAnswer,
    ForwardMeta,
    RestoreRequest,
    RestoreSummary,
    StageError,
    WorkerInfo,
)
from cacheflow_common.transport import frames
from cacheflow_services.http_limits import BodyTooLargeError
from cacheflow_services.worker.engine import ConflictError, StageEngine, UnknownRequestError
from cacheflow_services.worker.next_stage import NextStageError
from cacheflow_services.worker.routes import RouteGate, check_routes
from cacheflow_services.worker.trust import GrantedStores, WorkerTrust

_STATUS: list[tuple[type[Exception], int]] = [
    (UnknownRequestError, 404), (ConflictError, 409), (BoundaryMissingError, 409), (RestoreCancelledError, 409),
    (PoolFullError, 503), (GrantError, 403),
    (NextStageError, 502), (BadRequestError, 400),
]

Meta = TypeVar("Meta", bound=BaseModel)  # a typed frame header: ForwardMeta, DeliverMeta


def create_app(engine: StageEngine, *, max_body_bytes: int, max_json_bytes: int, trust: WorkerTrust,
               stores: GrantedStores) -> FastAPI:
    """The API over `engine`, whose tenants' storage placements are `stores` (what each grant authorizes)."""
    app = FastAPI(title=f"CacheFlow stage {engine.config.stage} worker", docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.add_middleware(RouteGate, trust=trust, stage=engine.config.stage, max_json_bytes=max_json_bytes,
                       max_frame_bytes=max_body_bytes)

    for exc_type, status in [(BodyTooLargeError, 413), *_STATUS]:
        app.add_exception_handler(exc_type, _handler(status))

    async def body_of(request: Request) -> bytes:
        length = request.headers.get("content-length", "")
        if not length.isdigit() or int(length) > max_body_bytes:
            raise BadRequestError(f"a body of 1..{max_body_bytes} bytes with a Content-Length is required")
        return await request.body()

    def granted(request: Request, *, request_id: str = "", tenant: str = "", digest: str = "") -> Grant:
        """The call's grant (verified by the gate), bound to what the call names, now spent."""
        grant: Grant = request.state.grant
        grant.check(request_id=request_id, tenant=tenant, digest=digest)
        trust.spent.spend(grant)
        stores.authorize(grant)
        return grant

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """Ready while the pool has room for a typical request."""
        ready = engine.can_admit_typical()
        body = {"ready": ready, "stage": engine.config.stage, "free_blocks": engine.pool.free_blocks}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/v1/info")
    def info(request: Request) -> WorkerInfo:
        granted(request)
        c = engine.config
        return WorkerInfo(stage=c.stage, layers=(c.layers.start, c.layers.stop), last_stage=c.last_stage,
                          model=engine.model.fingerprint(), chunk_size=c.chunk_size, dtype=str(engine.model.dtype),
                          pool_blocks=engine.pool.capacity_blocks, block_tokens=c.block_tokens,
                          vocab_size=engine.model.config.vocab_size,
                          max_tokens=min(engine.model.config.max_position_embeddings, c.max_request_tokens),
                          policy=c.policy, step_tokens=c.step_tokens, busy=BusyTotals(**engine.busy()),
                          kv_heads=engine.model.config.num_kv_heads)

    @app.post("/v1/restore")
    def restore(body: RestoreRequest, request: Request) -> RestoreSummary:
        try:
            grant = granted(request, request_id=body.request_id, tenant=body.tenant,
                            digest=input_digest(body.token_ids, reserve=body.reserve_tokens))
            return engine.restore(body.request_id, body.token_ids, tenant=body.tenant, input_mode=body.input,
                                  reserve_tokens=body.reserve_tokens, policy=body.policy,
                                  waited_s=body.waited_s, save=grant.save, max_tokens=grant.max_tokens,
                                  digest=grant.digest, deliver_grant=body.deliver_grant)
        except Exception as exc:
            engine.metrics.restore_failures.labels(type(exc).__name__).inc()
            raise

    @app.post("/v1/forward")
    async def forward(request: Request) -> ForwardAnswer:
        meta, hidden = frames.unpack(await body_of(request))
        asked = _validated(ForwardMeta, meta)
        _check_finite(hidden)
        grant = granted(request, request_id=asked.request_id, tenant=asked.tenant,
                        digest=input_digest(asked.token_ids, start=asked.start, reserve=asked.reserve_tokens))
        checked = asked.model_copy(update={"save": asked.save and grant.save})
        relayed = request.headers.get(GRANT_HEADER, "")  # the next stage checks the same grant
        return await anyio.to_thread.run_sync(lambda: engine.forward(checked, hidden, max_tokens=grant.max_tokens,
                                                                     grant=relayed))

    @app.post("/v1/deliver")
    async def deliver(request: Request) -> dict[str, bool]:
        meta, hidden = frames.unpack(await body_of(request))
        checked = _validated(DeliverMeta, meta)
        grant: Grant = request.state.grant  # one grant opens one stream of deliveries: spent when it finishes
        grant.check(request_id=checked.request_id, tenant=grant.tenant, digest=grant.digest)
        if checked.finished:
            engine.finish_upstream(grant, checked.failure)
            trust.spent.spend(grant)
        elif hidden is None:
            raise BadRequestError("a delivery carries the chunk's hidden states")
        else:
            _check_finite(hidden)
            engine.deliver(grant, checked.index, hidden)
        return {"ok": True}

    @app.get("/v1/requests/{request_id}/kv")
    def kv(request_id: str, request: Request) -> Response:
        """The request's KV on this stage, [L_s, 2, Hkv, tokens, D], as a tensor frame (for inspection and tests)."""
        grant: Grant = request.state.grant
        granted(request, request_id=request_id, tenant=grant.tenant)
        return Response(frames.pack({"request_id": request_id}, engine.kv_of(request_id, tenant=grant.tenant)),
                        media_type=frames.CONTENT_TYPE)

    @app.post("/v1/flush")
    async def flush(request: Request) -> dict[str, bool]:
        """Wait until every chunk computed so far is stored (before a drain, or in tests)."""
        granted(request)
        await anyio.to_thread.run_sync(engine.flush)
        return {"flushed": True}

    @app.delete("/v1/requests/{request_id}")
    def release(request_id: str, request: Request) -> dict[str, bool]:
        grant: Grant = request.state.grant
        granted(request, request_id=request_id, tenant=grant.tenant)
        return {"released": engine.release(request_id, tenant=grant.tenant)}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    check_routes(app)  # every route is in the table of credentials, or the worker does not start
    return app


def _check_finite(hidden: torch.Tensor | None) -> None:
    if hidden is not None and not bool(torch.isfinite(hidden).all()):
        raise BadRequestError("hidden states must be finite: NaN or Inf sent")


def _handler(status: int) -> Any:
    """Every error answer is a `StageError`: ours, or the one a stage further down relayed."""

    async def handle(_: Request, exc: Exception) -> JSONResponse:
        answer = exc.relayed if isinstance(exc, NextStageError) else StageError(error=type(exc).__name__,
                                                                                 detail=str(exc))
        return JSONResponse(answer.model_dump(), status_code=status)

    return handle


def _validated(model: type[Meta], meta: dict[str, Any]) -> Meta:
    """A frame's metadata (its JSON header, decoded) as the typed message, or a 400 naming the bad field."""
    try:
        return model.model_validate(meta)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadRequestError(f"bad frame metadata: {where}: {first['msg']}") from exc
