"""The request body limit of the coordinator's and the storage pods' HTTP APIs (HTTP 413 naming it), on
the bytes actually read: a Content-Length over the limit is refused before any byte is read, and a body
without one (chunked) as soon as what was read passes the limit, so a client cannot make a service
buffer more than `max_bytes`. `BearerFirst` answers a request without a valid bearer token 401 before
any of its body is read (outside `BodyLimit`, so no token is a 401 whatever the body)."""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

UNAUTHORIZED = "missing or wrong bearer token"
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # probes and Prometheus: no token, no tenant data


class BodyTooLargeError(HTTPException):
    """A request body over the limit (HTTP 413). An HTTPException, so that FastAPI passes it on from its body
    parsing as it is (any other error there becomes a 400 "error parsing the body")."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over {limit} bytes, the limit here (max_body_bytes)")


class BodyLimit:
    """ASGI middleware: reading a request's body past `max_bytes` raises BodyTooLargeError (and tells
    `on_refused`, for metrics)."""

    def __init__(self, app: ASGIApp, max_bytes: int, on_refused: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        too_long = declared.isdigit() and int(declared) > self.max_bytes
        read = 0

        async def limited() -> Message:
            nonlocal read
            if too_long:
                raise self._refused()
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > self.max_bytes:
                    raise self._refused()
            return message

        await self.app(scope, limited, send)

    def _refused(self) -> BodyTooLargeError:
        self.on_refused()
        return BodyTooLargeError(self.max_bytes)


def bearer_token(authorization: str) -> str:
    """The token of an `Authorization: Bearer <token>` header ("" for any other header)."""
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class BearerFirst:
    """ASGI middleware: a request on a path that `needs_token` is answered at once, its body unread, with
    what `refuse` makes of it (a 401 saying why), unless `authenticate` knows its bearer token; the tenant
    it names is left in `request.state.tenant`."""

    def __init__(self, app: ASGIApp, *, authenticate: Callable[[str], str | None], needs_token: Callable[[str], bool],
                 refuse: Callable[[Scope], Response]) -> None:
        self.app = app
        self.authenticate = authenticate  # token -> tenant, or None
        self.needs_token = needs_token
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.needs_token(scope["path"]):
            tenant = self.authenticate(bearer_token(Headers(scope=scope).get("authorization", "")))
            if tenant is None:
                await self.refuse(scope)(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
