"""The control API's guard (ASGI middleware): authenticate before reading a byte of the body, then read
the body only up to the limit, whatever the request declares (Content-Length or chunked).

Every path but the probes and /metrics needs a bearer token; the guard checks it first, so a
client without one is answered 401 at once and its body is never read. The body is then read here,
counting the bytes that actually arrive: past `max_body_bytes` the answer is 413 and the rest is
not read. The tenant is left in the request's state for the routes (`request.state.tenant`).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
UNAUTHORIZED = "missing or wrong bearer token"


def bearer_token(authorization: str) -> str:
    """The token of an `Authorization: Bearer <token>` header ("" for any other header)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def unauthorized() -> JSONResponse:
    return JSONResponse({"detail": UNAUTHORIZED}, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class RequestGuard:
    def __init__(self, app: ASGIApp, *, authenticate: Callable[[str], str | None], max_body_bytes: int,
                 on_refused: Callable[[str], None]) -> None:
        self.app = app
        self.authenticate = authenticate  # token -> tenant, or None
        self.max_body_bytes = max_body_bytes
        self.on_refused = on_refused  # told the reason of every refusal ("unauthorized", "body_too_large")

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
        declared = headers.get("content-length")
        body = None
        if declared is None or (declared.isdigit() and int(declared) <= self.max_body_bytes):
            body = await self._read_body(receive)
        if body is None:
            self.on_refused("body_too_large")
            too_large = JSONResponse({"detail": f"request body over {self.max_body_bytes} bytes"}, status_code=413)
            await too_large(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None as soon as it passes the limit."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app sees an empty body
                return bytes(body)
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return bytes(body)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives the app the body already read, then whatever the client sends next."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
