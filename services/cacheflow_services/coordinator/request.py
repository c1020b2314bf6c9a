"""One admitted request, and its log: every line on a request's path starts with its id, so one grep of
the coordinator's log follows a request from its queue place to its first token (or its failure)."""

from __future__ import annotations

import logging
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from cacheflow_common.stage_api import RestoreSummary
from cacheflow_services.coordinator.admission import Ticket

_log = logging.getLogger("cacheflow_services.coordinator.requests")


class RequestLog(logging.LoggerAdapter[logging.Logger]):
    """A logger that starts every line with a request's id (the line cannot forget it)."""

    def __init__(self, request_id: str, logger: logging.Logger = _log) -> None:
        super().__init__(logger, {"request_id": request_id})
        self.request_id = request_id

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{self.request_id} {msg}", kwargs


@dataclass
class Request:
    """One admitted piece of work: a completion, or a restore held for later."""

    id: str
    tenant: str
    token_ids: list[int]  # the whole prompt (a restore: the prefix)
    cached_tokens: int  # tokens [0, cached) are restored from storage; the rest are prefilled
    policy: str  # the restore policy sent to the workers ("" = theirs)
    ticket: Ticket
    arrived: float  # perf_counter() before its prefix lookup: TTFT counts from here
    lookup_s: float  # finding how much of the prompt the pods hold
    queue_s: float = 0.0  # lookup done -> admitted
    stages: list[RestoreSummary] = field(default_factory=list)  # per-stage restore summaries
    restore_s: float = 0.0
    cancelled: threading.Event = field(default_factory=threading.Event)  # stopped: its failures are not failures

    @property
    def log(self) -> RequestLog:
        return RequestLog(self.id)
