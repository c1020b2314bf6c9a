"""The coordinator's errors as OpenAI's API answers them, on every route (the restore API too), so that the
official SDKs and the clients built like them (LangChain, LiteLLM, ...) show the reason:

    {"error": {"message": <the reason>, "type": <kind>, "param": <the field at fault, or null>,
               "code": <a stable code, or null>}}

`type` and `code` are stable (clients may branch on them, never on the message); the HTTP status says the
same as `type`. A failure after a stream began is the same object in an SSE event (`openai_api.sse`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cacheflow_common.errors import BadRequestError
from cacheflow_services.coordinator.admission import AdmissionTimeoutError, QueueFullError
from cacheflow_services.coordinator.chain_error import ChainError
from cacheflow_services.coordinator.cluster import StageDownError
from cacheflow_services.coordinator.held_restores import UnknownRestoreError
from cacheflow_services.coordinator.intake import TenantRefusedError

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class UnknownModelError(BadRequestError):
    """The request names a model this cluster does not serve (HTTP 404)."""


@dataclass(frozen=True)
class ErrorKind:
    """What an error is, to a client: its HTTP status, OpenAI's `type` and a stable `code`."""

    status: int
    type: str
    code: str | None = None

    def body(self, message: str, param: str | None = None) -> dict[str, Any]:
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}


# The errors the coordinator raises on purpose; a subclass before its base (UnknownModelError: a BadRequestError).
KINDS: dict[type[Exception], ErrorKind] = {
    UnknownModelError: ErrorKind(404, INVALID_REQUEST, "model_not_found"),
    UnknownRestoreError: ErrorKind(404, "not_found_error", "restore_not_found"),
    TenantRefusedError: ErrorKind(403, "permission_error", "tenant_refused"),
    BadRequestError: ErrorKind(400, INVALID_REQUEST, "invalid_request"),
    QueueFullError: ErrorKind(429, "rate_limit_error", "queue_full"),
    StageDownError: ErrorKind(503, SERVER_ERROR, "stage_down"),
    AdmissionTimeoutError: ErrorKind(503, SERVER_ERROR, "admission_timeout"),
    ChainError: ErrorKind(502, SERVER_ERROR, "stage_failed"),
}
UNAUTHENTICATED = ErrorKind(401, "authentication_error", "invalid_api_key")
BODY_TOO_LARGE = ErrorKind(413, INVALID_REQUEST, "body_too_large")
INTERNAL = ErrorKind(500, SERVER_ERROR, "internal_error")
# HTTP errors Starlette raises itself (no route, a method the route lacks), by status
HTTP_KINDS = {401: UNAUTHENTICATED, 404: ErrorKind(404, INVALID_REQUEST, "unknown_url"),
              405: ErrorKind(405, INVALID_REQUEST, "method_not_allowed"), 413: BODY_TOO_LARGE}
# a refused body field, by pydantic's error type; any other: "invalid_value"
FIELD_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter",
               "unsupported": "unsupported_value", "json_invalid": "invalid_json"}


def kind_of(exc: BaseException) -> ErrorKind:
    """The kind of an error the coordinator raised (its nearest class in KINDS), else an internal error."""
    return next((KINDS[cls] for cls in type(exc).__mro__ if cls in KINDS), INTERNAL)


def http_kind(status: int) -> ErrorKind:
    return HTTP_KINDS.get(status) or ErrorKind(status, INVALID_REQUEST if status < 500 else SERVER_ERROR)


def field_kind(pydantic_type: str) -> ErrorKind:
    """A 400 for a body that failed validation (pydantic's error type: "missing", "extra_forbidden", ...)."""
    return ErrorKind(400, INVALID_REQUEST, FIELD_CODES.get(pydantic_type, "invalid_value"))
