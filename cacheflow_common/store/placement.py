"""Placement over storage pods: rendezvous hashing, replication, and many reads at once.

Each chunk name ranks every pod by `blake2b(pod id, name)`; its `replicas` copies live on the
highest-ranked live pods. Adding or losing one pod moves only the chunks it ranks first for (about
1/M of them), and every client computes the same placement from the same pod list, with no
coordination. A pod that failed recently is skipped for `down_for_s`; a read tries the copies in
rank order and is a miss only when none answers (the restore then recomputes the chunk).
"""

from __future__ import annotations

import hashlib
import ssl
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from cacheflow_common.errors import ConfigError, StoreError
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.transport.pod_client import PodAddress, PodClient


class PodStore(ChunkStore, Protocol):
    def failed_within(self, seconds: float) -> bool: ...


def rendezvous_score(pod_id: str, name: str) -> int:
    digest = hashlib.blake2b(f"{pod_id}\0{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class ClusterStore:
    """A `ChunkStore` over many pods (each a `PodClient`, or any store with `failed_within`)."""

    name = "cluster"

    def __init__(self, pods: dict[str, PodStore], *, replicas: int = 1, down_for_s: float = 5.0,
                 max_parallel: int = 16) -> None:
        if not pods:
            raise ConfigError("a cluster store needs at least one pod")
        if not 1 <= replicas <= len(pods):
            raise ConfigError(f"{replicas} replicas over {len(pods)} pods")
        self.pods = dict(pods)  # pod id -> store
        self.replicas = replicas
        self.down_for_s = down_for_s  # a pod that failed is skipped this long, then tried again
        self._readers = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="cluster-read")

    def ranked(self, name: str) -> list[str]:
        """Pod ids, best first, for `name` (all pods, live or not)."""
        return sorted(self.pods, key=lambda pod_id: rendezvous_score(pod_id, name), reverse=True)

    def placement(self, name: str) -> list[str]:
        """The pods that hold (or will hold) `name`: the first `replicas` live ones in rank order."""
        ranked = self.ranked(name)
        live = [p for p in ranked if not self.pods[p].failed_within(self.down_for_s)]
        return (live or ranked)[: self.replicas]

    def put(self, name: str, data: bytes | memoryview) -> None:
        """Store on every replica; acknowledged when at least one holds it durably (StoreError if none)."""
        errors = []
        stored = 0
        for pod_id in self.placement(name):
            try:
                self.pods[pod_id].put(name, data)
                stored += 1
            except StoreError as exc:
                errors.append(str(exc))
        if not stored:
            raise StoreError(f"no pod stored {name}: {'; '.join(errors)}")

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        return self.readv_into(name, [buf], offset)

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        return any(self.pods[p].readv_into(name, views, offset) for p in self.placement(name))

    def read_many(self, requests: Sequence[tuple[str, memoryview, int]]) -> list[bool]:
        """Many (name, buffer, offset) reads at once, spread over the pods that hold them."""
        return list(self._readers.map(lambda req: self.read_into(*req), requests))

    def read(self, name: str) -> bytes | None:
        for pod_id in self.placement(name):
            data = self.pods[pod_id].read(name)
            if data is not None:
                return data
        return None

    def size(self, name: str) -> int | None:
        for pod_id in self.placement(name):
            size = self.pods[pod_id].size(name)
            if size is not None:
                return size
        return None

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def delete(self, name: str) -> None:
        for pod_id in self.ranked(name)[: self.replicas]:
            self.pods[pod_id].delete(name)

    def close(self) -> None:
        self._readers.shutdown(wait=False)


def tenant_stores(pods: Sequence[PodAddress], pod_tokens: dict[str, str], *,
                  replicas: int = 1, tls: ssl.SSLContext | None = None) -> dict[str, ClusterStore]:
    """One placement over all `pods` per tenant, each authenticating with that tenant's token (over TLS with `tls`)."""
    return {tenant: ClusterStore({a.pod_id: PodClient(a, token, tls=tls) for a in pods}, replicas=replicas)
            for tenant, token in pod_tokens.items()}
