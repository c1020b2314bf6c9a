"""Who may hold a data-plane connection, so that no one can lock the tenants out by holding sockets.

A connection is *pending* until its hello authenticates it, and pending connections are capped on
their own (`max_pending_connections`): when one more arrives, the oldest pending one is closed, so
idle or trickling sockets without a token cannot fill the pod, and a client that sends its hello at
once always gets through (the hello must also be complete within `hello_timeout_s`). Authenticated
connections are capped in total (`max_connections`) and per tenant (`connections_per_tenant`), so a
tenant can only use up its own connections.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import Counter, OrderedDict

from cacheflow_services.storage.config import StorageConfig
from cacheflow_services.storage.metrics import StorageMetrics

log = logging.getLogger(__name__)


class ConnectionGate:
    def __init__(self, config: StorageConfig, metrics: StorageMetrics) -> None:
        self.max_pending = config.max_pending_connections
        self.max_open = config.max_connections
        self.per_tenant = config.connections_per_tenant()
        self.metrics = metrics
        self._pending: OrderedDict[socket.socket, None] = OrderedDict()  # oldest first
        self._tenants: Counter[str] = Counter()
        self._lock = threading.Lock()

    def arrive(self, sock: socket.socket) -> None:
        """A new connection, pending until `authenticate`; closes the oldest pending one when there are too many."""
        with self._lock:
            self._pending[sock] = None
            evicted = self._pending.popitem(last=False)[0] if len(self._pending) > self.max_pending else None
            self.metrics.pending.set(len(self._pending))
        if evicted is not None:
            self.metrics.refused.labels("pending").inc()
            try:
                evicted.shutdown(socket.SHUT_RDWR)  # its thread's read ends; that thread closes it
            except OSError as exc:  # already gone
                log.debug("closing an evicted pending connection: %s", exc)

    def replace(self, sock: socket.socket, secured: socket.socket) -> None:
        """The pending connection `sock` is now `secured` (wrapped in TLS): evicting it closes that."""
        with self._lock:
            if sock in self._pending and sock is not secured:
                del self._pending[sock]
                self._pending[secured] = None

    def authenticate(self, sock: socket.socket, tenant: str) -> str:
        """Count the connection as the tenant's; "" when admitted, else why it is refused."""
        with self._lock:
            if sock not in self._pending:
                return "connection closed to make room for newer ones"
            del self._pending[sock]
            self.metrics.pending.set(len(self._pending))
            if sum(self._tenants.values()) >= self.max_open:
                reason = "connections"
            elif self._tenants[tenant] >= self.per_tenant:
                reason = "tenant_connections"
            else:
                self._tenants[tenant] += 1
                self.metrics.connections.set(sum(self._tenants.values()))
                return ""
        self.metrics.refused.labels(reason).inc()
        return f"too many connections ({reason.replace('_', ' ')})"

    def leave(self, sock: socket.socket, tenant: str) -> None:
        """The connection closes; `tenant` is "" unless `authenticate` admitted it."""
        with self._lock:
            if sock in self._pending:
                del self._pending[sock]
                self.metrics.pending.set(len(self._pending))
            if tenant:
                self._tenants[tenant] -= 1
                self.metrics.connections.set(sum(self._tenants.values()))
