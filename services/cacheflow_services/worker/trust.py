"""What a stage worker trusts (`cacheflow_common.auth`): the internal token on every `/v1` call, a grant
from the coordinator on every call (its operation, this stage, the request, tenant and tokens), each
grant once (`SpentGrants`), and only the storage credentials that grants bring.

A worker holds no tenant's storage token: `GrantedStores` builds each tenant's placement over the pods
the first time a grant for that tenant arrives, and authenticates it with the newest pod credential a
grant brought (short-lived; the pods close a connection once its credential expires, and the client
reconnects with the newer one).
"""

from __future__ import annotations

import heapq
import ssl
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cacheflow_common.auth import CLOCK_SKEW_S, Grant, GrantVerifier, read_secret, tenant_of_token
from cacheflow_common.errors import GrantError
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.store.placement import ClusterStore
from cacheflow_common.transport.pod_client import PodAddress, PodClient


class SpentGrants:
    """The nonces of the grants this worker has used, each kept until its grant expires (an expired grant is
    refused anyway): a second use of a grant, a replay, is refused."""

    def __init__(self) -> None:
        self._spent: set[str] = set()
        self._by_expiry: list[tuple[float, str]] = []  # a heap: (when the nonce may be forgotten, nonce)
        self._lock = threading.Lock()

    def spend(self, grant: Grant) -> None:
        """Mark the grant used; GrantError if it was used before."""
        with self._lock:
            self._forget_expired()
            if grant.nonce in self._spent:
                raise GrantError(f"the grant for {grant.op} of request {grant.request_id!r} was used before "
                                 "(a grant is good for one call)")
            self._spent.add(grant.nonce)
            heapq.heappush(self._by_expiry, (grant.expires_at + CLOCK_SKEW_S, grant.nonce))

    def close(self, grant: Grant) -> None:
        """Mark the grant used, whether or not it was (a delivery stream whose request is gone)."""
        with self._lock:
            if grant.nonce not in self._spent:
                self._spent.add(grant.nonce)
                heapq.heappush(self._by_expiry, (grant.expires_at + CLOCK_SKEW_S, grant.nonce))

    def spent(self, grant: Grant) -> bool:
        with self._lock:
            return grant.nonce in self._spent

    def __len__(self) -> int:
        with self._lock:
            return len(self._spent)

    def _forget_expired(self) -> None:
        now = time.time()
        while self._by_expiry and self._by_expiry[0][0] < now:
            self._spent.discard(heapq.heappop(self._by_expiry)[1])


@dataclass(frozen=True)
class WorkerTrust:
    internal_token: str  # every /v1 call carries it (the coordinator's and the previous stage's)
    verifier: GrantVerifier  # checks the coordinator's grants (the public key only: cannot make one)
    spent: SpentGrants = field(default_factory=SpentGrants)

    @classmethod
    def from_files(cls, internal_token_file: Path | str, grant_key_file: Path | str) -> WorkerTrust:
        token = read_secret(internal_token_file, "internal token file").decode()
        return cls(token, GrantVerifier(read_secret(grant_key_file, "grant verifying key file")))

    def caller_of(self, token: str) -> str | None:
        """"cluster" for the internal token (whoever holds it is a component of this cluster), else None."""
        return tenant_of_token({self.internal_token: "cluster"}, token)

    def grant_for(self, text: str, *, op: str, stage: int) -> Grant:
        """The verified grant `text`, for `op` on `stage`, not used before (GrantError otherwise)."""
        grant = self.verifier.verify(text)
        grant.allows(op, stage)
        if self.spent.spent(grant):
            raise GrantError(f"the grant for {op} of request {grant.request_id!r} was used before "
                             "(a grant is good for one call)")
        return grant


class GrantedStores(Mapping[str, ChunkStore]):
    """tenant -> its placement over the storage pods, for the tenants a grant has been seen for."""

    def __init__(self, pods: Sequence[PodAddress], *, replicas: int, tls: ssl.SSLContext | None = None) -> None:
        self.pods = tuple(pods)
        self.replicas = replicas
        self.tls = tls  # the cluster CA's client context: pod connections over TLS
        self._stores: dict[str, ClusterStore] = {}
        self._clients: dict[str, list[PodClient]] = {}
        self._lock = threading.Lock()

    def authorize(self, grant: Grant) -> None:
        """From now on the tenant's pod connections authenticate with this grant's pod credential."""
        if not grant.pod_credential:
            return
        with self._lock:
            clients = self._clients.get(grant.tenant)
            if clients is None:
                clients = [PodClient(a, grant.pod_credential, tls=self.tls) for a in self.pods]
                self._clients[grant.tenant] = clients
                self._stores[grant.tenant] = ClusterStore({c.address.pod_id: c for c in clients},
                                                          replicas=self.replicas)
            for client in clients:
                client.token = grant.pod_credential  # new connections use it; old ones end with theirs

    def __getitem__(self, tenant: str) -> ChunkStore:
        with self._lock:
            return self._stores[tenant]

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._stores))

    def __len__(self) -> int:
        with self._lock:
            return len(self._stores)
