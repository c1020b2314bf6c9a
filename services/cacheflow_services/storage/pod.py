"""What a storage pod does, independent of how requests arrive (TCP, NIXL, HTTP).

Tenancy: every request runs as the tenant its bearer token belongs to, and names are stored inside
that tenant's namespace (`stored_name`), so no request can reach another tenant's objects even by
guessing their names. Integrity: a PUT must be one whole, consistent chunk object; every read is
checked section by section before it is served, and a copy that fails is counted, dropped and
answered as CORRUPT (a miss to the reader, which recomputes).
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from cacheflow_common.errors import BadRequestError, StoreError
from cacheflow_common.kv.chunk import SECTION_HEADER_SIZE, TRAILER_TAIL
from cacheflow_common.kv.integrity import object_problem, range_problem, section_size_of, sections_end_of
from cacheflow_common.kv.keys import valid_name
from cacheflow_common.store.base import ChunkStore, open_store
from cacheflow_common.store.lru import LruStore
from cacheflow_common.transport.wire import Status
from cacheflow_services.storage.config import StorageConfig
from cacheflow_services.storage.metrics import StorageMetrics

log = logging.getLogger(__name__)
_INFO_CACHE = 100_000  # object layouts remembered (a few MB), so a read costs no extra header reads


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    section_size: int
    sections_end: int


def open_backend(config: StorageConfig) -> ChunkStore:
    if config.backend == "memory":
        store = open_store("memory")
    elif config.backend == "filesystem":
        store = open_store(f"filesystem:{config.directory}")
    else:
        store = open_store(config.redis_url)
    if config.capacity_bytes:
        return LruStore(store, config.capacity_bytes)  # type: ignore[arg-type]  # memory/filesystem list entries
    return store


class StoragePod:
    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.backend = open_backend(config)
        self.metrics = StorageMetrics()
        self.metrics.capacity_bytes.set(config.capacity_bytes)
        self.metrics.rate.set(config.rate_bytes_per_s)
        self._info: OrderedDict[str, ObjectInfo] = OrderedDict()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------ access
    def tenant_of(self, token: str) -> str | None:
        """The tenant a bearer token belongs to, or None (every token compared in constant time)."""
        found = None
        for known, tenant in self.config.tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = tenant
        return found

    @staticmethod
    def stored_name(tenant: str, name: str) -> str:
        """The backend name of a tenant's object: tenant ids hold no dots, so the suffix is unambiguous."""
        if not valid_name(name) or len(name) > 128:
            raise BadRequestError(f"invalid object name {name!r}")
        return f"{name}.t-{tenant}"

    def check_length(self, length: int, what: str) -> None:
        if not 0 < length <= self.config.max_object_bytes:
            raise BadRequestError(f"{what} of {length} bytes: must be 1..{self.config.max_object_bytes}")

    # ------------------------------------------------------------------------------------ reads
    def read(self, tenant: str, name: str, offset: int, out: memoryview) -> tuple[Status, str]:
        """Fill `out` with bytes [offset, offset + len(out)) of the tenant's object, checked."""
        stored = self.stored_name(tenant, name)
        self.check_length(len(out), "a read")
        if offset < 0:
            raise BadRequestError(f"negative offset {offset}")
        info = self._object_info(stored)
        if info is None:
            return self._miss("absent")
        if offset + len(out) > info.size:
            return self._miss(f"range [{offset}, {offset + len(out)}) is outside the object ({info.size} bytes)")
        if not self.backend.read_into(stored, out, offset):
            return self._miss("absent")
        problem = range_problem(out, offset, info.section_size, info.sections_end)
        if problem:
            return self._corrupt(stored, problem)
        self.metrics.reads.labels("hit").inc()
        self.metrics.read_bytes.inc(len(out))
        return Status.OK, ""

    def _miss(self, reason: str) -> tuple[Status, str]:
        self.metrics.reads.labels("miss").inc()
        return Status.MISS, reason

    def _corrupt(self, stored: str, problem: str) -> tuple[Status, str]:
        log.warning("dropping corrupt object %s: %s", stored, problem)
        self.metrics.reads.labels("corrupt").inc()
        self._forget(stored)
        try:
            self.backend.delete(stored)  # never served again; the next save stores a good copy
        except StoreError as exc:
            log.warning("could not drop %s: %s", stored, exc)
        self._refresh_gauges()
        return Status.CORRUPT, problem

    def _object_info(self, stored: str) -> ObjectInfo | None:
        with self._lock:
            info = self._info.get(stored)
        if info is not None:
            return info
        size = self.backend.size(stored)
        if size is None:
            return None
        head, tail = bytearray(SECTION_HEADER_SIZE), bytearray(TRAILER_TAIL.size)
        if size < len(head) + len(tail) or not (
            self.backend.read_into(stored, memoryview(head), 0)
            and self.backend.read_into(stored, memoryview(tail), size - len(tail))
        ):
            return None  # vanished or truncated while we looked: a miss
        info = ObjectInfo(size, section_size_of(bytes(head)), sections_end_of(bytes(tail), size))
        self._remember(stored, info)
        return info

    def _remember(self, stored: str, info: ObjectInfo) -> None:
        with self._lock:
            self._info[stored] = info
            self._info.move_to_end(stored)
            while len(self._info) > _INFO_CACHE:
                self._info.popitem(last=False)

    def _forget(self, stored: str) -> None:
        with self._lock:
            self._info.pop(stored, None)

    def size(self, tenant: str, name: str) -> int | None:
        info = self._object_info(self.stored_name(tenant, name))
        return None if info is None else info.size

    def delete(self, tenant: str, name: str) -> None:
        stored = self.stored_name(tenant, name)
        self._forget(stored)
        self.backend.delete(stored)
        self._refresh_gauges()

    def exists(self, tenant: str, names: list[str]) -> list[bool]:
        if len(names) > self.config.max_names_per_query:
            raise BadRequestError(f"{len(names)} names in one query; at most {self.config.max_names_per_query}")
        stored = [self.stored_name(tenant, n) for n in names]  # all validated before any lookup
        return [self.backend.exists(s) for s in stored]

    # ------------------------------------------------------------------------------------ writes
    def write(self, tenant: str, name: str, data: memoryview) -> tuple[Status, str]:
        """Store a whole chunk object durably (acknowledged only once the backend has it)."""
        stored = self.stored_name(tenant, name)
        self.check_length(len(data), "an object")
        problem = object_problem(data)
        if problem:
            self.metrics.writes.labels("rejected").inc()
            raise BadRequestError(f"not a valid chunk object: {problem}")
        self._forget(stored)
        try:
            self.backend.put(stored, data)
        except StoreError as exc:
            self.metrics.writes.labels("failed").inc()
            return Status.UNAVAILABLE, str(exc)
        self.metrics.writes.labels("ok").inc()
        self.metrics.written_bytes.inc(len(data))
        self._refresh_gauges()
        return Status.OK, ""

    # ------------------------------------------------------------------------------------ state
    def _refresh_gauges(self) -> None:
        if isinstance(self.backend, LruStore):
            self.metrics.objects.set(self.backend.object_count)
            self.metrics.used_bytes.set(self.backend.used_bytes)
            self.metrics.evictions.set(self.backend.evictions)

    def ready(self) -> tuple[bool, str]:
        ping = getattr(self.backend, "ping", None)
        if ping is not None and not ping():
            return False, "backend unreachable"
        return True, ""

    def stats(self) -> dict[str, float | str]:
        """A summary for `GET /v1/stats`, read from the same registry `/metrics` exports."""
        self._refresh_gauges()
        sample = self.metrics.registry.get_sample_value

        def value(metric: str, **labels: str) -> float:
            return sample(metric, labels) or 0.0

        return {
            "backend": self.config.backend,
            "hits": value("cacheflow_storage_reads_total", result="hit"),
            "misses": value("cacheflow_storage_reads_total", result="miss"),
            "corrupt": value("cacheflow_storage_reads_total", result="corrupt"),
            "read_bytes": value("cacheflow_storage_read_bytes_total"),
            "writes": value("cacheflow_storage_writes_total", result="ok"),
            "objects": value("cacheflow_storage_objects"),
            "used_bytes": value("cacheflow_storage_used_bytes"),
            "capacity_bytes": self.config.capacity_bytes,
            "evictions": value("cacheflow_storage_evictions"),
            "rate_bytes_per_s": self.config.rate_bytes_per_s,
        }
