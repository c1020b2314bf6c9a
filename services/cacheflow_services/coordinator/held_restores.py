"""Restores held for later (`POST /v1/restore`): a prefix restored ahead of the completion that needs it.

A restore queues like a completion and climbs `RESTORE_LADDER` (boundary, then pipelined); its KV stays
held on the workers until it is released (`DELETE`) or `held_restore_s` passes. A cancel at any point
wins: its state stays `cancelled` and nothing is held. Each tenant holds at most `max_held_restores`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cacheflow_common.errors import BadRequestError
from cacheflow_services.coordinator.admission import QueueFullError
from cacheflow_services.coordinator.cluster import Cluster
from cacheflow_services.coordinator.config import CoordinatorConfig
from cacheflow_services.coordinator.failures import Failures
from cacheflow_services.coordinator.intake import Intake
from cacheflow_services.coordinator.ladder import RESTORE_LADDER
from cacheflow_services.coordinator.request import Request
from cacheflow_services.coordinator.restoring import PrefixRestore

KEEP_FINISHED_RESTORES = 1024  # finished restore records kept for GET
LIVE = ("queued", "restoring", "ready")  # the states that count against a tenant's limit


class UnknownRestoreError(BadRequestError):
    """No restore with this id for this tenant (HTTP 404)."""


@dataclass
class RestoreRecord:
    request: Request
    state: str = "queued"  # queued | restoring | ready | failed | cancelled | released
    error: str = ""
    expires: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)

    def view(self) -> dict[str, Any]:
        r = self.request
        return {"id": r.id, "state": self.state, "error": self.error, "prefix_tokens": len(r.token_ids),
                "cached_tokens": r.cached_tokens, "policy": r.policy, "batch": r.ticket.batch,
                "lookup_s": r.lookup_s, "queue_s": r.queue_s, "restore_s": r.restore_s,
                "stages": [s.model_dump() for s in r.stages]}


class HeldRestores:
    def __init__(self, config: CoordinatorConfig, cluster: Cluster, intake: Intake, restore: PrefixRestore,
                 failures: Failures) -> None:
        self.config = config
        self.cluster = cluster
        self.intake = intake
        self.restore = restore
        self.failures = failures
        self._records: dict[str, RestoreRecord] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        """Stop reaping and free every restore still held."""
        self._stop.set()
        with self._lock:
            held = [r for r in self._records.values() if r.state == "ready"]
        for record in held:
            self._release(record)

    def start(self, request: Request) -> RestoreRecord:
        """Restore `request`'s prefix and hold it; QueueFullError (429) when its tenant already has
        `max_held_restores` queued, restoring or held (its queue place is given back)."""
        record = RestoreRecord(request)
        with self._lock:
            held = sum(1 for r in self._records.values() if r.request.tenant == request.tenant and r.state in LIVE)
            if held >= self.config.max_held_restores:
                self.intake.leave_slot(request)
                raise QueueFullError(f"tenant {request.tenant!r} holds {held} restores (the limit per tenant): "
                                     "release one (DELETE /v1/restore/{id}) or retry later")
            self._records[request.id] = record
        threading.Thread(target=self._run, args=(record,), name=f"restore-{request.id}", daemon=True).start()
        return record

    def record(self, restore_id: str, tenant: str) -> RestoreRecord:
        with self._lock:
            record = self._records.get(restore_id)
        if record is None or record.request.tenant != tenant:  # another tenant's id looks like no id
            raise UnknownRestoreError(f"no restore {restore_id!r}")
        return record

    def cancel(self, restore_id: str, tenant: str) -> RestoreRecord:
        """Cancel a queued or running restore (it leaves the queue, or every stage stops it), or release a
        finished one's KV."""
        record = self.record(restore_id, tenant)
        if self._advance(record, ("queued", "restoring"), "cancelled"):
            self.intake.stop(record.request)
        else:
            self._release(record)
        return record

    def _run(self, record: RestoreRecord) -> None:
        """Queue, then restore; a cancel at any point wins (its state stays `cancelled`, nothing held)."""
        request = record.request
        try:
            if not self.intake.wait_turn(request) or not self._advance(record, "queued", "restoring"):
                return
            self.restore.climb(request, RESTORE_LADDER, room=None)
            record.expires = time.monotonic() + self.config.held_restore_s
            self._advance(record, "restoring", "ready")
        except Exception as exc:
            self.failures.record(request, exc)
            if self._advance(record, ("queued", "restoring"), "failed"):
                record.error = str(exc)
        finally:
            self.intake.leave_slot(request)
            if record.state == "cancelled":  # cancelled while it restored: free what the stages still hold
                self.cluster.chain.release(request.id, request.tenant)
            record.done.set()

    def _advance(self, record: RestoreRecord, before: str | tuple[str, ...], after: str) -> bool:
        """Move a restore from (one of) `before` to `after`, unless something (a cancel) moved it first."""
        with self._lock:
            if record.state not in ((before,) if isinstance(before, str) else before):
                return False
            record.state = after
            return True

    def _release(self, record: RestoreRecord) -> None:
        """Free a ready restore's KV (once, whoever asks first)."""
        if self._advance(record, "ready", "released"):
            self.cluster.chain.release(record.request.id, record.request.tenant)

    def _reap_loop(self) -> None:
        """Free restores held past their time; forget the oldest finished records."""
        while not self._stop.wait(1.0):
            now = time.monotonic()
            with self._lock:
                expired = [r for r in self._records.values() if r.state == "ready" and r.expires < now]
                finished = [k for k, r in self._records.items() if r.state in ("failed", "cancelled", "released")]
                for key in finished[: max(0, len(finished) - KEEP_FINISHED_RESTORES)]:
                    del self._records[key]
            for record in expired:
                self._release(record)
