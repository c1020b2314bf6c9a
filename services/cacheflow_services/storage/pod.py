"""What a storage pod does, independent of how requests arrive (TCP, NIXL, HTTP).

Tenancy: every request runs as the tenant its bearer token belongs to, and names are stored inside
that tenant's namespace (`stored_name`), so no request can reach another tenant's objects even by
guessing their names. With a capacity, each tenant is guaranteed a share of it (`LruStore`'s owners):
it may borrow what others leave unused, and loses objects to another tenant's writes only while over
its share. Counts in `stats` are the tenant's own. Integrity: a PUT must be one whole, consistent
chunk object; every read is checked section by section before it is served, and a copy that fails
is counted, dropped and answered as CORRUPT (a miss to the reader, which recomputes). An object too
short to be a chunk object (truncated) is such a copy too: dropped, and absent to a STAT or an exists.

Replacement: a write, a delete, the drop of a bad copy and the caching of an object's layout each hold
the object's lock (one of `_STRIPES`), and a bad copy is dropped only if no write of that lock's
objects came since its read was planned, so neither a layout read from the old copy nor the drop of
the old copy can outlive the new one (it did: a chunk rewritten after it was found corrupt could be
deleted by a slower reader of the old copy, or served from its stale layout as a miss).
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass

from cacheflow_common.auth import POD_CREDENTIAL_PREFIX, pod_credential_tenant, tenant_of_token
from cacheflow_common.errors import BadRequestError, StoreError
from cacheflow_common.kv.chunk import SECTION_HEADER_SIZE, TRAILER_TAIL
from cacheflow_common.kv.integrity import object_problem, range_problem, section_size_of, sections_end_of
from cacheflow_common.kv.keys import valid_name
from cacheflow_common.store.base import ChunkStore, open_store
from cacheflow_common.store.lru import LruStore
from cacheflow_common.transport.wire import Status
from cacheflow_services.storage.buffers import BufferBudget
from cacheflow_services.storage.config import StorageConfig
from cacheflow_services.storage.metrics import StorageMetrics, TenantCounts
from cacheflow_services.storage.reads import ReadPlan

log = logging.getLogger(__name__)
_TENANT_MARK = ".t-"  # stored name = name + mark + tenant
_INFO_CACHE = 100_000  # object layouts remembered (a few MB), so a read costs no extra header reads
_STRIPES = 64  # locks that writes, deletes, drops and layout reads of one object take


@dataclass(frozen=True)
class ObjectInfo:
    size: int
    section_size: int
    sections_end: int

    @property
    def chunk_like(self) -> bool:
        """Whole sections, then a trailer: anything else (a truncated object) can never be served."""
        return self.section_size > 0 and self.sections_end > 0 and self.sections_end % self.section_size == 0


def open_backend(config: StorageConfig) -> ChunkStore:
    if config.backend == "memory":
        store = open_store("memory")
    elif config.backend == "filesystem":
        store = open_store(f"filesystem:{config.directory}")
    else:
        store = open_store(config.redis_url)
    if config.capacity_bytes:  # memory/filesystem: they list their entries
        return LruStore(store, config.capacity_bytes,  # type: ignore[arg-type]
                        owner_of=StoragePod.tenant_of_stored, shares=config.share_of_every_tenant())
    return store


class StoragePod:
    def __init__(self, config: StorageConfig) -> None:
        self.config = config
        self.backend = open_backend(config)
        self.metrics = StorageMetrics()
        self.metrics.watch(config, self.backend)  # configuration, and what the backend holds
        self.metrics.capacity_bytes.set(config.capacity_bytes)
        self.metrics.rate.set(config.rate_bytes_per_s)
        self.tenant_counts = TenantCounts()
        self.buffers = BufferBudget(config.max_buffered_bytes)
        self._info: OrderedDict[str, ObjectInfo] = OrderedDict()
        self._lock = threading.Lock()
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._writes = [0] * _STRIPES  # writes and deletes under each stripe so far

    # ------------------------------------------------------------------------------------ access
    def tenant_of(self, token: str) -> str | None:
        """The tenant a bearer token, or a worker's short-lived pod credential (`cacheflow_common.auth`),
        belongs to; None if neither (every token compared in constant time)."""
        if token.startswith(POD_CREDENTIAL_PREFIX):
            return pod_credential_tenant(token, self.config.tokens)
        return tenant_of_token(self.config.tokens, token)

    @staticmethod
    def stored_name(tenant: str, name: str) -> str:
        """The backend name of a tenant's object: tenant ids hold no dots, so the suffix is unambiguous."""
        if not valid_name(name) or len(name) > 128:
            raise BadRequestError(f"invalid object name {name!r}")
        return f"{name}{_TENANT_MARK}{tenant}"

    @staticmethod
    def tenant_of_stored(stored: str) -> str:
        """The tenant of a backend name ("" for a name stored without one)."""
        _, mark, tenant = stored.rpartition(_TENANT_MARK)
        return tenant if mark else ""

    def check_length(self, length: int, what: str) -> None:
        if not 0 < length <= self.config.max_object_bytes:
            raise BadRequestError(f"{what} of {length} bytes: must be 1..{self.config.max_object_bytes}")

    # ------------------------------------------------------------------------------------ reads
    def plan_read(self, tenant: str, name: str, offset: int, length: int) -> ReadPlan | tuple[Status, str]:
        """How to stream bytes [offset, offset + length) of the tenant's object, or the miss to answer."""
        stored = self.stored_name(tenant, name)
        self.check_length(length, "a read")
        if offset < 0:
            raise BadRequestError(f"negative offset {offset}")
        writes = self._writes[self._stripe(stored)]  # before the layout: a write after it makes the plan old
        info = self._object_info(stored)
        if info is None:
            return self._miss(tenant, "absent")
        if not info.chunk_like:
            return self._corrupt(tenant, stored, f"not a whole chunk object ({info.size} bytes): truncated?", writes)
        if offset + length > info.size:
            self._forget(stored)  # looked up again next time, in case the layout remembered is an old copy's
            return self._miss(tenant, f"range [{offset}, {offset + length}) is outside the object ({info.size} bytes)")
        return ReadPlan(tenant=tenant, stored=stored, offset=offset, length=length, section_size=info.section_size,
                        sections_end=info.sections_end, writes=writes)

    def read_piece(self, plan: ReadPlan, start: int, out: memoryview) -> tuple[Status, str]:
        """Fill `out` with the plan's bytes from `start` on (relative to its offset), checked."""
        if not self.backend.read_into(plan.stored, out, plan.offset + start):
            self._forget(plan.stored)  # evicted or deleted since its layout was remembered
            return self._miss(plan.tenant, "absent")
        problem = range_problem(out, plan.offset + start, plan.section_size, plan.sections_end)
        if problem and self._replaced(plan):  # read with an old copy's layout: the new copy is not corrupt
            return self._miss(plan.tenant, "replaced while it was read")
        if problem:
            return self._corrupt(plan.tenant, plan.stored, problem, plan.writes)
        return Status.OK, ""

    def _replaced(self, plan: ReadPlan) -> bool:
        """Whether the object's layout, read again now, differs from the one the read was planned with (it
        was replaced behind this pod's back, e.g. by another pod on a shared Redis); the new one is kept."""
        self._forget(plan.stored)
        info = self._object_info(plan.stored)
        return info is None or (info.section_size, info.sections_end) != (plan.section_size, plan.sections_end)

    def count_hit(self, plan: ReadPlan) -> None:
        """A read served whole."""
        self.metrics.reads.labels("hit").inc()
        self.metrics.read_bytes.inc(plan.length)
        self.tenant_counts.add(plan.tenant, "hits")
        self.tenant_counts.add(plan.tenant, "read_bytes", plan.length)

    def _miss(self, tenant: str, reason: str) -> tuple[Status, str]:
        self.metrics.reads.labels("miss").inc()
        self.tenant_counts.add(tenant, "misses")
        return Status.MISS, reason

    def _corrupt(self, tenant: str, stored: str, problem: str, writes: int) -> tuple[Status, str]:
        """Count and drop a bad copy, read while the object's stripe had seen `writes` writes: a copy
        written since then is a replacement, and stays."""
        self.metrics.reads.labels("corrupt").inc()
        self.tenant_counts.add(tenant, "corrupt")
        stripe = self._stripe(stored)
        with self._stripes[stripe]:
            self._forget(stored)
            if self._writes[stripe] != writes:
                log.warning("corrupt copy of %s (%s) not dropped: written again since it was read", stored, problem)
                return Status.CORRUPT, problem
            log.warning("dropping corrupt object %s: %s", stored, problem)
            try:
                self.backend.delete(stored)  # never served again; the next save stores a good copy
            except StoreError as exc:
                log.warning("could not drop %s: %s", stored, exc)
        self.refresh_gauges()
        return Status.CORRUPT, problem

    @staticmethod
    def _stripe(stored: str) -> int:
        return zlib.crc32(stored.encode()) % _STRIPES

    def _object_info(self, stored: str) -> ObjectInfo | None:
        with self._lock:
            info = self._info.get(stored)
        if info is not None:
            return info
        with self._stripes[self._stripe(stored)]:  # no write between reading the layout and remembering it
            size = self.backend.size(stored)
            if size is None:
                return None
            head, tail = bytearray(SECTION_HEADER_SIZE), bytearray(TRAILER_TAIL.size)
            if size < len(head) + len(tail):
                return ObjectInfo(size, 0, 0)  # too short to be a chunk object: not chunk_like
            if not (self.backend.read_into(stored, memoryview(head), 0)
                    and self.backend.read_into(stored, memoryview(tail), size - len(tail))):
                return None  # vanished while we looked: a miss
            info = ObjectInfo(size, section_size_of(bytes(head)), sections_end_of(bytes(tail), size))
            if info.chunk_like:
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
        """The object's size; None when it is absent, or not a whole chunk object (then dropped)."""
        return self._whole_size(tenant, self.stored_name(tenant, name))

    def _whole_size(self, tenant: str, stored: str) -> int | None:
        writes = self._writes[self._stripe(stored)]
        if not self.backend.exists(stored):  # asked each time: the layout cache outlives evictions
            self._forget(stored)
            return None
        info = self._object_info(stored)
        if info is not None and not info.chunk_like:
            self._corrupt(tenant, stored, f"not a whole chunk object ({info.size} bytes): truncated?", writes)
            return None
        return None if info is None else info.size

    def delete(self, tenant: str, name: str) -> None:
        stored = self.stored_name(tenant, name)
        stripe = self._stripe(stored)
        with self._stripes[stripe]:
            self._writes[stripe] += 1
            self._forget(stored)
            self.backend.delete(stored)
        self.refresh_gauges()

    def exists(self, tenant: str, names: list[str]) -> list[bool]:
        if len(names) > self.config.max_names_per_query:
            raise BadRequestError(f"{len(names)} names in one query; at most {self.config.max_names_per_query}")
        stored = [self.stored_name(tenant, n) for n in names]  # all validated before any lookup
        return [self._whole_size(tenant, s) is not None for s in stored]

    # ------------------------------------------------------------------------------------ writes
    def write(self, tenant: str, name: str, data: memoryview) -> tuple[Status, str]:
        """Store a whole chunk object durably (acknowledged only once the backend has it)."""
        stored = self.stored_name(tenant, name)
        self.check_length(len(data), "an object")
        problem = object_problem(data)
        if problem:
            self.metrics.writes.labels("rejected").inc()
            raise BadRequestError(f"not a valid chunk object: {problem}")
        stripe = self._stripe(stored)
        try:
            with self._stripes[stripe]:  # see the module's docstring: replacement
                self._writes[stripe] += 1
                self._forget(stored)
                self.backend.put(stored, data)
        except StoreError as exc:
            self.metrics.writes.labels("failed").inc()
            return Status.UNAVAILABLE, str(exc)
        self.metrics.writes.labels("ok").inc()
        self.metrics.written_bytes.inc(len(data))
        self.tenant_counts.add(tenant, "writes")
        self.refresh_gauges()
        return Status.OK, ""

    # ------------------------------------------------------------------------------------ state
    def refresh_gauges(self) -> None:
        """Bring the pod-wide gauges /metrics exports up to date."""
        self.metrics.buffered_bytes.set(self.buffers.held_bytes)
        if isinstance(self.backend, LruStore):
            self.metrics.objects.set(self.backend.object_count)
            self.metrics.used_bytes.set(self.backend.used_bytes)
            self.metrics.evictions.set(self.backend.evictions)

    def ready(self) -> tuple[bool, str]:
        ping = getattr(self.backend, "ping", None)
        if ping is not None and not ping():
            return False, "backend unreachable"
        return True, ""

    def stats(self, tenant: str) -> dict[str, float | str]:
        """`GET /v1/stats` for one tenant: its own counts, objects and share (the pod's are on /metrics)."""
        objects, used, evictions = self._usage(tenant)
        return {
            "backend": self.config.backend,
            **self.tenant_counts.of(tenant),
            "objects": objects,
            "used_bytes": used,
            "share_bytes": self.config.share_of_every_tenant().get(tenant, 0),
            "evictions": evictions,
            "rate_bytes_per_s": self.config.rate_bytes_per_s,
        }

    def _usage(self, tenant: str) -> tuple[int, int, int]:
        """(objects, bytes, objects evicted) of the tenant; zeros without a capacity (nothing is counted)."""
        if isinstance(self.backend, LruStore):
            return self.backend.usage(tenant)
        return 0, 0, 0
