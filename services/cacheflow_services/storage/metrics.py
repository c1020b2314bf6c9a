"""Prometheus metrics of one storage pod (its own registry, so several pods can live in one test process).

Every series exists from start-up (reads and writes by result at 0), and the pod's state gauges read the
backend when scraped (`watch`): objects and bytes stored count what the backend holds, also objects
written before this process started. No label is named like a scrape's target label (see the
coordinator's metrics).

The link capacity (what the dashboard's I/O utilisation divides the bytes served by) is never 0, so that
panel has a line for every pod: `--link-capacity-gbps`, else the shaping rate, else the speed the pod's
network interface reports, else DEFAULT_LINK_GBPS; `cacheflow_storage_link_capacity_source_info` says which.
"""

from __future__ import annotations

import threading
from collections import Counter as Tally
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge

from cacheflow_services.storage.config import StorageConfig

TENANT_COUNTS = ("hits", "misses", "corrupt", "read_bytes", "writes")  # what /v1/stats counts per tenant
# every reason a request is refused (admission.py, dataplane.py, http_guard.py)
REFUSALS = ("pending", "unauthorized", "hello_timeout", "body_too_large", "connections", "tenant_connections")
DEFAULT_LINK_GBPS = 10.0  # the capacity of an unshaped pod whose interface reports no speed (a common pod NIC)
SYS_NET = Path("/sys/class/net")  # one directory per network interface; `speed` in Mbit/s where the driver knows it


class StorageMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.reads = Counter("cacheflow_storage_reads", "Chunk reads by result", ["result"], registry=r)
        self.read_bytes = Counter("cacheflow_storage_read_bytes", "Bytes served to readers", registry=r)
        self.writes = Counter("cacheflow_storage_writes", "Chunk writes by result", ["result"], registry=r)
        self.written_bytes = Counter("cacheflow_storage_written_bytes", "Bytes stored", registry=r)
        self.evictions = Gauge("cacheflow_storage_evictions", "Objects evicted for capacity", registry=r)
        self.objects = Gauge("cacheflow_storage_objects", "Objects stored (memory/filesystem)", registry=r)
        self.used_bytes = Gauge("cacheflow_storage_used_bytes", "Bytes stored (memory/filesystem)", registry=r)
        self.capacity_bytes = Gauge("cacheflow_storage_capacity_bytes", "Capacity (0: unlimited)", registry=r)
        self.rate = Gauge("cacheflow_storage_link_bytes_per_second", "Shaped outgoing rate (0: unshaped)", registry=r)
        self.link_capacity = Gauge("cacheflow_storage_link_capacity_bytes_per_second", "The outgoing link's "
                                   "capacity: --link-capacity-gbps, else the shaped rate, else the network "
                                   f"interface's speed, else {DEFAULT_LINK_GBPS:g} Gbit/s", registry=r)
        self.link_capacity_source = Gauge("cacheflow_storage_link_capacity_source_info", "1, labelled with where "
                                          "the link capacity comes from (given, shaped, nic, default)", ["source"],
                                          registry=r)
        self.backend = Gauge("cacheflow_storage_backend_info", "1, labelled with the pod's storage backend",
                             ["backend"], registry=r)
        self.connections = Gauge("cacheflow_storage_connections", "Open authenticated data-plane connections",
                                 registry=r)
        self.pending = Gauge("cacheflow_storage_pending_connections", "Data-plane connections still in their hello",
                             registry=r)
        self.buffered_bytes = Gauge("cacheflow_storage_buffered_bytes", "Request bytes held in memory", registry=r)
        self.refused = Counter("cacheflow_storage_refused", "Requests refused, by reason", ["reason"], registry=r)
        for result in ("hit", "miss", "corrupt"):
            self.reads.labels(result)  # export zeros from the start: dashboards see the series before traffic
        for result in ("ok", "rejected", "failed"):
            self.writes.labels(result)
        for reason in REFUSALS:
            self.refused.labels(reason)

    def watch(self, config: StorageConfig, backend: object) -> None:
        """The pod's configuration, and gauges that read the backend when scraped."""
        self.capacity_bytes.set(config.capacity_bytes)
        self.rate.set(config.rate_bytes_per_s)
        capacity, source = link_capacity(config)
        self.link_capacity.set(capacity)
        self.link_capacity_source.labels(source).set(1)
        self.backend.labels(config.backend).set(1)
        usage = BackendUsage(backend)
        self.objects.set_function(lambda: usage.read()[0])
        self.used_bytes.set_function(lambda: usage.read()[1])


def link_capacity(config: StorageConfig, sys_net: Path = SYS_NET) -> tuple[float, str]:
    """The pod's outgoing link capacity in bytes/s, and where it comes from."""
    if config.link_capacity_bytes_per_s:
        return config.link_capacity_bytes_per_s, "given"
    if config.rate_bytes_per_s:
        return config.rate_bytes_per_s, "shaped"
    nic = nic_bytes_per_s(sys_net)
    return (nic, "nic") if nic else (DEFAULT_LINK_GBPS * 1e9 / 8, "default")


def nic_bytes_per_s(sys_net: Path = SYS_NET) -> float:
    """The fastest speed a network interface that is up reports, in bytes/s (a pod has one, eth0); 0 when none
    does (loopback is left out; virtual interfaces often report -1 or refuse to be read)."""
    speeds = [0]
    for interface in sys_net.glob("*"):
        if interface.name == "lo" or _read(interface / "operstate") == "down":
            continue
        speed = _read(interface / "speed")
        speeds.append(int(speed) if speed.isdigit() else 0)  # Mbit/s; "-1": unknown
    return max(speeds) * 1e6 / 8


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # absent, or a driver that refuses (EINVAL for a link that is down)
        return ""


class BackendUsage:
    """(objects, bytes) a backend holds: an LRU index's running totals, else a listing of the store (memory,
    filesystem: one directory walk per scrape); zeros for a backend that cannot list (Redis)."""

    def __init__(self, backend: object) -> None:
        self.backend = backend

    def read(self) -> tuple[int, int]:
        count, used = getattr(self.backend, "object_count", None), getattr(self.backend, "used_bytes", None)
        if isinstance(count, int) and isinstance(used, int):
            return count, used
        entries = getattr(self.backend, "entries", None)
        if entries is None:
            return 0, 0
        listed: list[tuple[str, int]] = entries()
        return len(listed), sum(size for _, size in listed)


class TenantCounts:
    """Per-tenant request counts for `GET /v1/stats` (a tenant sees only its own; /metrics has the pod's)."""

    def __init__(self) -> None:
        self._counts: dict[str, Tally[str]] = {}
        self._lock = threading.Lock()

    def add(self, tenant: str, what: str, n: int = 1) -> None:
        with self._lock:
            self._counts.setdefault(tenant, Tally())[what] += n

    def of(self, tenant: str) -> dict[str, int]:
        with self._lock:
            counts = self._counts.get(tenant, Tally())
            return {what: counts[what] for what in TENANT_COUNTS}
