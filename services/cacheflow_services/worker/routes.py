"""Every route of a stage worker's API and the credential it needs, in one table (`ROUTES`), and the
middleware that enforces it (`RouteGate`) before any of a request's body is read.

A route is either `PUBLIC` (the probes and Prometheus: no tenant's data, no work) or `GRANT`: the call
carries the cluster's internal token (`Authorization: Bearer`, else 401) and a grant from the
coordinator (`X-CacheFlow-Grant`) for the route's operation on this stage, signed, unexpired and not
used before (else 403). The handler then binds the grant to what the call names (request, tenant, a
digest of its tokens) and spends it. `create_app` refuses to build an app with a route missing from
this table (`check_routes`), so a new route cannot go without a credential.

A body is limited by its route's kind before it is read: none, JSON (`max_json_bytes`) or a tensor
frame (`max_frame_bytes`), so neither a stranger nor a caller with a grant makes the worker buffer or
parse more (HTTP 413).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.routing import compile_path
from starlette.types import ASGIApp, Receive, Scope, Send

from cacheflow_common.auth import GRANT_HEADER
from cacheflow_common.errors import GrantError
from cacheflow_services.http_limits import BodyLimit, bearer_token
from cacheflow_services.worker.trust import WorkerTrust

NOT_INTERNAL = "this API is internal to the cluster: missing or wrong internal token"


class Credential(Enum):
    PUBLIC = "public"  # probes and metrics
    GRANT = "grant"  # the internal token and a coordinator's grant for the route's operation on this stage


class Body(Enum):
    NONE = "none"
    JSON = "json"
    FRAME = "frame"


@dataclass(frozen=True)
class WorkerRoute:
    method: str
    path: str  # as FastAPI declares it, e.g. "/v1/requests/{request_id}/kv"
    credential: Credential
    op: str = ""  # the grant's operation (GRANT routes)
    body: Body = Body.NONE

    @property
    def key(self) -> str:
        return f"{self.method} {self.path}"


ROUTES: tuple[WorkerRoute, ...] = (
    WorkerRoute("GET", "/healthz", Credential.PUBLIC),
    WorkerRoute("GET", "/readyz", Credential.PUBLIC),
    WorkerRoute("GET", "/metrics", Credential.PUBLIC),
    WorkerRoute("GET", "/v1/info", Credential.GRANT, "info"),
    WorkerRoute("POST", "/v1/restore", Credential.GRANT, "restore", Body.JSON),
    WorkerRoute("POST", "/v1/forward", Credential.GRANT, "forward", Body.FRAME),
    WorkerRoute("POST", "/v1/deliver", Credential.GRANT, "deliver", Body.FRAME),
    WorkerRoute("GET", "/v1/requests/{request_id}/kv", Credential.GRANT, "read"),
    WorkerRoute("DELETE", "/v1/requests/{request_id}", Credential.GRANT, "release"),
    WorkerRoute("POST", "/v1/flush", Credential.GRANT, "flush"),
)
_PATTERNS = [(route, compile_path(route.path)[0]) for route in ROUTES]


def route_of(method: str, path: str) -> WorkerRoute | None:
    """The declared route a request is for (None: no such route)."""
    return next((r for r, pattern in _PATTERNS if r.method == method and pattern.match(path)), None)


def routes_without_grant(declared: Iterable[WorkerRoute] = ROUTES) -> list[str]:
    """`/v1` routes that a caller could reach without a grant (the chaos bench's key; 0 by the table)."""
    return [r.key for r in declared if r.path.startswith("/v1/") and r.credential is not Credential.GRANT]


def check_routes(app: Any) -> None:
    """RuntimeError unless every route `app` serves is declared in `ROUTES` (FastAPI's own docs are off)."""
    served = {f"{m} {route.path}" for route in app.routes if hasattr(route, "methods")
              for m in route.methods if m != "HEAD"}
    if undeclared := sorted(served - {r.key for r in ROUTES}):
        raise RuntimeError(f"worker routes without a declared credential: {undeclared}")


class RouteGate:
    """ASGI middleware: a request is answered at once, its body unread, when its route is unknown (404),
    it lacks the internal token (401) or a grant for the route's operation on this stage (403); else the
    verified grant is left in `request.state.grant` and the body read within its route's limit."""

    def __init__(self, app: ASGIApp, *, trust: WorkerTrust, stage: int, max_json_bytes: int,
                 max_frame_bytes: int) -> None:
        self.app = app
        self.trust = trust
        self.stage = stage
        self.limits = {Body.NONE: 0, Body.JSON: max_json_bytes, Body.FRAME: max_frame_bytes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_of(scope["method"], scope["path"])
        if route is None:
            await _refuse(404, "NotFound", f"no route {scope['method']} {scope['path']}", scope, receive, send)
            return
        if route.credential is Credential.PUBLIC:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self.trust.caller_of(bearer_token(headers.get("authorization", ""))) is None:
            await _refuse(401, "UnauthorizedError", NOT_INTERNAL, scope, receive, send)
            return
        try:
            grant = self.trust.grant_for(headers.get(GRANT_HEADER.lower(), ""), op=route.op, stage=self.stage)
        except GrantError as exc:
            await _refuse(403, "GrantError", str(exc), scope, receive, send)
            return
        scope.setdefault("state", {})["grant"] = grant
        await BodyLimit(self.app, self.limits[route.body])(scope, receive, send)


async def _refuse(status: int, error: str, detail: str, scope: Scope, receive: Receive, send: Send) -> None:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    await JSONResponse({"error": error, "detail": detail}, status_code=status, headers=headers)(scope, receive, send)

