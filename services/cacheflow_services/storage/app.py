"""The pod's control API (FastAPI): health, readiness, bulk existence queries, stats, Prometheus metrics.

Everything but health, readiness and metrics needs `Authorization: Bearer <token>`, checked before
the body is read, and answers for the token's tenant only (`http_guard`). Bulk data never goes
through here: it uses the data plane (`dataplane`).
"""

# No `from __future__ import annotations`: FastAPI must see the real `Depends(tenant)` of a local function.
from typing import Annotated, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel

from cacheflow_common.errors import BadRequestError
from cacheflow_services.storage.http_guard import UNAUTHORIZED, RequestGuard
from cacheflow_services.storage.pod import StoragePod

MAX_BODY_BYTES = 1 << 20  # the largest control request (4096 names of ~60 characters is ~300 KB)


class ExistsRequest(BaseModel):
    names: list[str]


def create_app(pod: StoragePod, *, data_port: int, transport: str) -> FastAPI:
    app = FastAPI(title="CacheFlow storage pod", docs_url=None, redoc_url=None)

    app.add_middleware(RequestGuard, authenticate=pod.tenant_of, max_body_bytes=MAX_BODY_BYTES,
                       on_refused=lambda reason: pod.metrics.refused.labels(reason).inc())

    @app.exception_handler(BadRequestError)
    async def bad_request(_: Request, exc: BadRequestError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    def tenant(request: Request) -> str:
        found = getattr(request.state, "tenant", None)  # set by RequestGuard on every path that needs a token
        if not isinstance(found, str):
            raise HTTPException(401, UNAUTHORIZED, headers={"WWW-Authenticate": "Bearer"})
        return found

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        ok, reason = pod.ready()
        return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)

    @app.post("/v1/chunks/exists")
    def exists(body: ExistsRequest, who: Annotated[str, Depends(tenant)]) -> dict[str, list[bool]]:
        return {"exists": pod.exists(who, body.names)}

    @app.get("/v1/stats")
    def stats(who: Annotated[str, Depends(tenant)]) -> dict[str, Any]:
        return {"tenant": who, "data_port": data_port, "transport": transport, **pod.stats(who)}

    @app.get("/metrics")
    def metrics() -> Response:
        pod.refresh_gauges()
        return Response(generate_latest(pod.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
