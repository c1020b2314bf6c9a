"""A storage pod's configuration (frozen, built from the command line or the cluster spec)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from cacheflow_common.errors import ConfigError
from cacheflow_common.units import parse_bytes

TENANT_OK = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # used with fullmatch; no dots (see StoragePod.stored_name)
MIN_TOKEN_CHARS = 16  # a bearer token shorter than this is a configuration mistake, not a secret


@dataclass(frozen=True, kw_only=True)
class StorageConfig:
    backend: str = "filesystem"  # memory | filesystem | redis
    directory: Path | None = None  # filesystem only
    redis_url: str = ""  # redis only, e.g. redis://127.0.0.1:6379/0
    capacity_bytes: int = 0  # memory/filesystem: LRU eviction above this; 0 = unlimited (redis: use maxmemory)
    rate_bytes_per_s: float = 0.0  # outgoing link shaping; 0 = unshaped
    link_capacity_bytes_per_s: float = 0.0  # the outgoing link's capacity (metrics); 0: see metrics.link_capacity
    transport: str = "auto"  # tcp | nixl | auto (TCP: what the cluster's own readers use; see storage/main.py)
    host: str = "127.0.0.1"
    data_port: int = 0  # 0: any free port (printed when ready)
    http_port: int = 0
    tokens: dict[str, str] = field(default_factory=dict)  # bearer token -> tenant
    tenant_shares: dict[str, int] = field(default_factory=dict)  # tenant -> bytes of capacity it is guaranteed
    max_object_bytes: int = 256 * 1024 * 1024  # largest PUT and largest read
    max_buffered_bytes: int = 1024 * 1024 * 1024  # request bytes the pod holds in memory at once, all connections
    max_connections: int = 256  # authenticated data-plane connections served at once; more are refused
    max_tenant_connections: int = 0  # of those, per tenant (0: max_connections shared evenly by the tenants)
    max_pending_connections: int = 64  # connections still in their hello; a new one closes the oldest
    max_names_per_query: int = 4096  # names in one bulk existence query
    hello_timeout_s: float = 5.0  # a connection must have sent its whole hello (token) within this
    idle_timeout_s: float = 60.0  # an authenticated connection idle this long between requests is closed
    io_timeout_s: float = 30.0  # a client silent this long mid-request is dropped

    def __post_init__(self) -> None:
        if self.backend not in ("memory", "filesystem", "redis"):
            raise ConfigError(f"unknown backend {self.backend!r}: use memory, filesystem or redis")
        if self.backend == "filesystem" and self.directory is None:
            raise ConfigError("the filesystem backend needs a directory")
        if self.backend == "redis" and not self.redis_url:
            raise ConfigError("the redis backend needs a URL (redis://host:port/db)")
        if self.backend == "redis" and self.capacity_bytes:
            raise ConfigError("set the capacity of a Redis backend in Redis (maxmemory, allkeys-lru)")
        if self.transport not in ("tcp", "nixl", "auto"):
            raise ConfigError(f"unknown transport {self.transport!r}: use tcp, nixl or auto")
        if min(self.capacity_bytes, self.rate_bytes_per_s, self.link_capacity_bytes_per_s) < 0 or \
                self.max_object_bytes <= 0:
            raise ConfigError("capacity, rate and object size limits must not be negative")
        self._check_limits()
        if not self.tokens:
            raise ConfigError("a storage pod needs at least one bearer token (a token file: 'tenant token' lines)")
        for token, tenant in self.tokens.items():
            if not TENANT_OK.fullmatch(tenant):
                raise ConfigError(f"bad tenant id {tenant!r}: lowercase letters, digits and '-', at most 63")
            if len(token) < MIN_TOKEN_CHARS or not token.isprintable() or " " in token:
                raise ConfigError(f"the token of tenant {tenant!r} must be >= {MIN_TOKEN_CHARS} printable characters")
        self._check_shares()

    def _check_limits(self) -> None:
        if self.max_buffered_bytes < self.max_object_bytes:
            raise ConfigError(f"max_buffered_bytes ({self.max_buffered_bytes}) must hold at least one object "
                              f"of max_object_bytes ({self.max_object_bytes})")
        counts = (self.max_connections, self.max_pending_connections)
        if min(counts) < 1 or self.max_tenant_connections < 0:
            raise ConfigError("connection limits must be positive (max_tenant_connections: 0 = an even share)")
        if min(self.hello_timeout_s, self.idle_timeout_s, self.io_timeout_s) <= 0:
            raise ConfigError("hello, idle and I/O timeouts must be positive")

    def _check_shares(self) -> None:
        unknown = sorted(set(self.tenant_shares) - set(self.tenants))
        if unknown:
            raise ConfigError(f"capacity share for tenants without a token: {', '.join(unknown)}")
        if self.tenant_shares and not self.capacity_bytes:
            raise ConfigError("tenant capacity shares need a pod capacity (--capacity)")
        if any(b < 0 for b in self.tenant_shares.values()) or sum(self.tenant_shares.values()) > self.capacity_bytes:
            raise ConfigError(f"tenant capacity shares ({sum(self.tenant_shares.values())} bytes in all) must not "
                              f"be negative nor exceed the capacity ({self.capacity_bytes})")

    @property
    def tenants(self) -> list[str]:
        """Every tenant that has a token, sorted."""
        return sorted(set(self.tokens.values()))

    def share_of_every_tenant(self) -> dict[str, int]:
        """Capacity each tenant is guaranteed: its explicit share, else an even split of what the others leave."""
        rest = [t for t in self.tenants if t not in self.tenant_shares]
        left = self.capacity_bytes - sum(self.tenant_shares.values())
        return {**{t: left // len(rest) for t in rest}, **self.tenant_shares}

    def connections_per_tenant(self) -> int:
        """The most authenticated connections one tenant may hold at once."""
        even = max(1, self.max_connections // len(self.tenants))
        return min(self.max_tenant_connections or even, self.max_connections)


def parse_tenant_shares(items: list[str]) -> dict[str, int]:
    """`TENANT=SIZE` items (`acme=10GiB`) -> tenant -> bytes; ConfigError for anything else."""
    shares: dict[str, int] = {}
    for item in items:
        tenant, sep, size = item.partition("=")
        if not sep or not tenant or tenant in shares:
            raise ConfigError(f"bad tenant share {item!r}: expected TENANT=SIZE, each tenant once")
        shares[tenant] = parse_bytes(size)
    return shares


def read_token_file(path: Path) -> dict[str, str]:
    """Bearer tokens from a file of `tenant token` lines ('#' comments); token -> tenant."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc}") from exc
    tokens: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            raise ConfigError(f"{path}:{number}: expected 'tenant token'")
        tenant, token = words
        if token in tokens:
            raise ConfigError(f"{path}:{number}: a token is listed twice")
        tokens[token] = tenant
    return tokens
