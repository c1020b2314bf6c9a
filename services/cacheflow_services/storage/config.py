"""A storage pod's configuration (frozen, built from the command line or the cluster spec)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from cacheflow_common.errors import ConfigError

TENANT_OK = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")  # used with fullmatch; no dots (see StoragePod.stored_name)
MIN_TOKEN_CHARS = 16  # a bearer token shorter than this is a configuration mistake, not a secret


@dataclass(frozen=True, kw_only=True)
class StorageConfig:
    backend: str = "filesystem"  # memory | filesystem | redis
    directory: Path | None = None  # filesystem only
    redis_url: str = ""  # redis only, e.g. redis://127.0.0.1:6379/0
    capacity_bytes: int = 0  # memory/filesystem: LRU eviction above this; 0 = unlimited (redis: use maxmemory)
    rate_bytes_per_s: float = 0.0  # outgoing link shaping; 0 = unshaped
    transport: str = "auto"  # tcp | nixl | auto (NIXL when it imports, else TCP)
    host: str = "127.0.0.1"
    data_port: int = 0  # 0: any free port (printed when ready)
    http_port: int = 0
    tokens: dict[str, str] = field(default_factory=dict)  # bearer token -> tenant
    max_object_bytes: int = 256 * 1024 * 1024  # largest PUT and largest read: bounds every allocation
    max_connections: int = 256  # data-plane connections served at once; more are refused
    max_names_per_query: int = 4096  # names in one bulk existence query
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
        if self.capacity_bytes < 0 or self.rate_bytes_per_s < 0 or self.max_object_bytes <= 0:
            raise ConfigError("capacity, rate and object size limits must not be negative")
        if not self.tokens:
            raise ConfigError("a storage pod needs at least one bearer token (a token file: 'tenant token' lines)")
        for token, tenant in self.tokens.items():
            if not TENANT_OK.fullmatch(tenant):
                raise ConfigError(f"bad tenant id {tenant!r}: lowercase letters, digits and '-', at most 63")
            if len(token) < MIN_TOKEN_CHARS or not token.isprintable() or " " in token:
                raise ConfigError(f"the token of tenant {tenant!r} must be >= {MIN_TOKEN_CHARS} printable characters")


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
