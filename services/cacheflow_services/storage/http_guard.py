"""The control API's guard (ASGI middleware): authenticate before reading a byte of the body, then let
the app read the body only up to the limit, whatever the request declares (Content-Length or chunked).

Every path but the probes and /metrics needs a bearer token; the guard checks it first, so a
client without one is answered 401 at once and its body is never read. The body is then bounded by
the services' shared `BodyLimit`, counting the bytes that actually arrive: past `max_body_bytes` the
answer is 413 and the rest is not read. The tenant is left in the request's state for the routes
(`request.state.tenant`).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from cacheflow_services.http_limits import PUBLIC_PATHS, UNAUTHORIZED, BodyLimit, bearer_token

__all__ = ["UNAUTHORIZED", "RequestGuard", "unauthorized"]


def unauthorized() -> JSONResponse:
    return JSONResponse({"detail": UNAUTHORIZED}, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class RequestGuard:
    def __init__(self, app: ASGIApp, *, authenticate: Callable[[str], str | None], max_body_bytes: int,
                 on_refused: Callable[[str], None]) -> None:
        self.app = app
        self.authenticate = authenticate  # token -> tenant, or None
        self.on_refused = on_refused  # told the reason of every refusal ("unauthorized", "body_too_large")
        self.limited = BodyLimit(app, max_body_bytes, on_refused=lambda: on_refused("body_too_large"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if scope["path"] not in PUBLIC_PATHS:
            tenant = self.authenticate(bearer_token(headers.get("authorization", "")))
            if tenant is None:
                self.on_refused("unauthorized")
                await unauthorized()(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.limited(scope, receive, send)
