"""Talking to the next stage: forwarding hidden states (suffix prefill, decode) and, in a pipelined
restore, delivering each computed chunk's output as soon as it exists.

Hidden states travel as tensor frames (`cacheflow_common.transport.frames`) over HTTP (HTTPS where the
cluster has TLS) on the stage-to-stage link, each call with the coordinator's grant for it: a forward
relays its own, deliveries carry the delivery grant the restore call brought. Deliveries go through a
queue and a sender thread, so the restore's compute pointer never waits for the network. A call whose
connection went stale is sent once more (`http_server.retry_on_stale_connection`).
"""

from __future__ import annotations

import logging
import queue
import threading

import httpx
import torch

from cacheflow_common.auth import GRANT_HEADER
from cacheflow_common.errors import BadRequestError, CacheFlowError
from cacheflow_common.stage_api import DeliverMeta, ForwardAnswer, ForwardMeta, StageError
from cacheflow_common.tls import TLSFiles
from cacheflow_common.transport import frames
from cacheflow_services.http_server import http_client, retry_on_stale_connection

log = logging.getLogger(__name__)


class NextStageError(CacheFlowError):
    """A stage down the pipeline failed or could not be reached (HTTP 502 to our caller). `relayed` is
    that stage's error as our caller must see it: its `hops` count from this stage (1: the next stage,
    2: the one after, relayed through the next), so whoever called this stage names the stage that
    failed rather than the first on the way."""

    def __init__(self, relayed: StageError) -> None:
        super().__init__(f"stage +{relayed.hops}: {relayed.detail}")
        self.relayed = relayed


class NextStage:
    def __init__(self, url: str, *, timeout_s: float, internal_token: str, tls: TLSFiles | None = None) -> None:
        self.url = url.rstrip("/")
        self._http = http_client(timeout=timeout_s, headers={"Authorization": f"Bearer {internal_token}"}, tls=tls)

    def forward(self, meta: ForwardMeta, hidden: torch.Tensor, grant: str) -> ForwardAnswer:
        """`grant`: the coordinator's for this forward, which the next stage checks too."""
        return ForwardAnswer.model_validate_json(self._post("/v1/forward", frames.pack(meta.model_dump(), hidden),
                                                            grant))

    def deliver(self, request_id: str, index: int, hidden: torch.Tensor, grant: str) -> None:
        self._post("/v1/deliver", frames.pack(DeliverMeta(request_id=request_id, index=index).model_dump(), hidden),
                   grant)

    def finish(self, request_id: str, grant: str, failure: str = "") -> None:
        meta = DeliverMeta(request_id=request_id, finished=True, failure=failure)
        self._post("/v1/deliver", frames.pack(meta.model_dump()), grant)

    def _post(self, path: str, body: bytes, grant: str) -> bytes:
        """The answer's body (JSON), or a typed error: the next stage unreachable, refusing, or failing."""
        headers = {"Content-Type": frames.CONTENT_TYPE, GRANT_HEADER: grant}
        try:
            response = retry_on_stale_connection(lambda: self._http.post(self.url + path, content=body,
                                                                         headers=headers))
        except httpx.HTTPError as exc:
            raise NextStageError(StageError(error=type(exc).__name__, hops=1, unreachable=True,
                                            detail=f"unreachable ({self.url}): {type(exc).__name__}: {exc}")) from exc
        if response.status_code >= 400:
            failed = StageError.of_response(response.status_code, response.content)
            if response.status_code < 500:
                raise BadRequestError(f"next stage refused: {failed.detail}")
            raise NextStageError(failed.model_copy(update={"hops": failed.hops + 1}))
        return response.content

    def close(self) -> None:
        self._http.close()


class DeliverySender:
    """Sends one pipelined restore's chunks to the next stage in order, from a thread of its own.

    With `hold`, nothing is sent before `finish`: the next stage starts computing only once this one
    is done, as when a pipeline-parallel engine runs a prefill stage after stage (the `sequential`
    baseline of the stage benchmark).
    """

    def __init__(self, next_stage: NextStage, request_id: str, grant: str, *, hold: bool = False) -> None:
        self.next_stage = next_stage
        self.request_id = request_id
        self.grant = grant  # the coordinator's delivery grant for this request on the next stage
        self.hold = hold
        self._held: list[tuple[int, torch.Tensor]] = []
        self._queue: queue.Queue[tuple[int, torch.Tensor] | str | None] = queue.Queue()
        self._error = ""
        self._thread = threading.Thread(target=self._run, name=f"deliver-{request_id}", daemon=True)
        self._thread.start()

    def deliver(self, index: int, hidden: torch.Tensor) -> None:
        item = (index, hidden.detach().clone())  # [T, hidden]; the caller's buffer moves on
        if self.hold:
            self._held.append(item)
        else:
            self._queue.put(item)

    def finish(self) -> None:
        for item in self._held:
            self._queue.put(item)
        self._queue.put(None)
        self._thread.join()

    def fail(self, reason: str) -> None:
        self._queue.put(reason)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if isinstance(item, tuple):
                    if not self._error:
                        self.next_stage.deliver(self.request_id, *item, self.grant)
                    continue
                self.next_stage.finish(self.request_id, self.grant, item or self._error)
            except CacheFlowError as exc:
                log.warning("delivery of %s to the next stage failed: %s", self.request_id, exc)
                self._error = str(exc)
                if isinstance(item, tuple):
                    continue
            return
