"""A stage worker's HTTP API (FastAPI): restore, forward, pipelined deliveries, release, health, metrics.

* `POST /v1/restore` (JSON): restore a request's cached prefix on this stage's layers.
* `POST /v1/forward` (tensor frame): run new tokens through this stage and the ones after it; the last
  stage answers with the next token.
* `POST /v1/deliver` (tensor frame): the previous stage's output for one chunk of a pipelined restore.
* `DELETE /v1/requests/{id}`: free the request's KV; `GET /v1/requests/{id}/kv`: read it back.
* `POST /v1/flush`: wait until every queued save is stored.

Every `/v1` call needs the cluster's internal token (`Authorization: Bearer`), checked before any of
the body is read; `restore` and `forward` also need the coordinator's grant for that request and
tenant (`trust.py`). `/healthz`, `/readyz` and `/metrics` are open (probes and Prometheus).

Errors carry their reason: 400 bad input, 401 no or wrong internal token, 403 no valid grant for the
request or tenant, 404 unknown request, 409 state conflict (wrong position, boundary activations
missing: restore pipelined instead), 502 the next stage failed, 503 pool full.
"""

# No `from __future__ import annotations`: FastAPI must see the real types of the route parameters.
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

from cacheflow_common.auth import Grant
from cacheflow_common.engine.core import RestoreCancelledError
from cacheflow_common.errors import BadRequestError, GrantError
from cacheflow_common.restore.stages import BoundaryMissingError
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
from cacheflow_services.http_limits import PUBLIC_PATHS, BearerFirst
from cacheflow_services.worker.engine import ConflictError, StageEngine, UnknownRequestError
from cacheflow_services.worker.next_stage import NextStageError
from cacheflow_services.worker.pool import PoolFullError
from cacheflow_services.worker.trust import GrantedStores, WorkerTrust

_STATUS: list[tuple[type[Exception], int]] = [
    (UnknownRequestError, 404), (ConflictError, 409), (BoundaryMissingError, 409), (RestoreCancelledError, 409),
    (PoolFullError, 503), (GrantError, 403),
    (NextStageError, 502), (BadRequestError, 400),
]

Meta = TypeVar("Meta", bound=BaseModel)  # a typed frame header: ForwardMeta, DeliverMeta


def create_app(engine: StageEngine, *, max_body_bytes: int, trust: WorkerTrust, stores: GrantedStores) -> FastAPI:
    """The API over `engine`, whose tenants' storage placements are `stores` (what each grant authorizes)."""
    app = FastAPI(title=f"CacheFlow stage {engine.config.stage} worker", docs_url=None, redoc_url=None)
    # every path but the probes and /metrics: the internal token, checked before a byte of the body is read
    app.add_middleware(BearerFirst, authenticate=trust.caller_of, needs_token=lambda path: path not in PUBLIC_PATHS,
                       detail="this API is internal to the cluster: missing or wrong internal token")

    for exc_type, status in _STATUS:
        app.add_exception_handler(exc_type, _handler(status))

    async def body_of(request: Request) -> bytes:
        length = request.headers.get("content-length", "")
        if not length.isdigit() or int(length) > max_body_bytes:
            raise BadRequestError(f"a body of 1..{max_body_bytes} bytes with a Content-Length is required")
        return await request.body()

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
    def info() -> WorkerInfo:
        c = engine.config
        return WorkerInfo(stage=c.stage, layers=(c.layers.start, c.layers.stop), last_stage=c.last_stage,
                          model=engine.model.fingerprint(), chunk_size=c.chunk_size, dtype=str(engine.model.dtype),
                          pool_blocks=engine.pool.capacity_blocks, block_tokens=c.block_tokens,
                          vocab_size=engine.model.config.vocab_size,
                          max_tokens=min(engine.model.config.max_position_embeddings, c.max_request_tokens),
                          policy=c.policy, step_tokens=c.step_tokens, busy=BusyTotals(**engine.busy()))

    def granted(grant: str, request_id: str, tenant: str) -> Grant:
        checked = trust.grant_for(grant, request_id=request_id, tenant=tenant)
        stores.authorize(checked)
        return checked

    @app.post("/v1/restore")
    def restore(body: RestoreRequest) -> RestoreSummary:
        try:
            grant = granted(body.grant, body.request_id, body.tenant)
            return engine.restore(body.request_id, body.token_ids, tenant=body.tenant, input_mode=body.input,
                                  reserve_tokens=body.reserve_tokens, policy=body.policy,
                                  waited_s=body.waited_s, save=grant.save, max_tokens=grant.max_tokens)
        except Exception as exc:
            engine.metrics.restore_failures.labels(type(exc).__name__).inc()
            raise

    @app.post("/v1/forward")
    async def forward(request: Request) -> ForwardAnswer:
        meta, hidden = frames.unpack(await body_of(request))
        asked = _validated(ForwardMeta, meta)
        grant = granted(asked.grant, asked.request_id, asked.tenant)
        checked = asked.model_copy(update={"save": asked.save and grant.save})
        return await anyio.to_thread.run_sync(lambda: engine.forward(checked, hidden, max_tokens=grant.max_tokens))

    @app.post("/v1/deliver")
    async def deliver(request: Request) -> dict[str, bool]:
        meta, hidden = frames.unpack(await body_of(request))
        checked = _validated(DeliverMeta, meta)
        if checked.finished:
            engine.finish_upstream(checked.request_id, checked.failure)
        elif hidden is None:
            raise BadRequestError("a delivery carries the chunk's hidden states")
        else:
            engine.deliver(checked.request_id, checked.index, hidden)
        return {"ok": True}

    @app.get("/v1/requests/{request_id}/kv")
    def kv(request_id: str) -> Response:
        """The request's KV on this stage, [L_s, 2, Hkv, tokens, D], as a tensor frame (for inspection and tests)."""
        return Response(frames.pack({"request_id": request_id}, engine.kv_of(request_id)),
                        media_type=frames.CONTENT_TYPE)

    @app.post("/v1/flush")
    async def flush() -> dict[str, bool]:
        """Wait until every chunk computed so far is stored (before a drain, or in tests)."""
        await anyio.to_thread.run_sync(engine.flush)
        return {"flushed": True}

    @app.delete("/v1/requests/{request_id}")
    def release(request_id: str) -> dict[str, bool]:
        return {"released": engine.release(request_id)}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


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
