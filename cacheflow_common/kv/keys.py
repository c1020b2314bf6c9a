"""Chunk keys: a blake2b chain over the previous key and each chunk's token ids, salted per model and tenant.

Chunk `i`'s key identifies the whole prefix up to the end of chunk `i`, so equal keys mean equal
prefixes (the token ids are checked again on a hit: the key digest sits in every stored section).
The salt mixes the model fingerprint and the tenant: a tenant can never name another tenant's chunks.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cacheflow_common.errors import BadRequestError

DIGEST_SIZE = 16  # 128-bit keys: collisions are out of reach for any realistic number of chunks
_KEY_DOMAIN = b"cacheflow/chunk-key/v1"
_NAME_OK = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


@dataclass(frozen=True)
class ChunkKey:
    """The key of the chunk holding tokens [token_start, token_end) of a prefix."""

    digest: bytes
    index: int
    token_start: int
    token_end: int

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def n_tokens(self) -> int:
        return self.token_end - self.token_start


def tenant_salt(model_fingerprint: str, tenant: str) -> bytes:
    """The salt of every key of `tenant` on the model `model_fingerprint`."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for part in (_KEY_DOMAIN, model_fingerprint.encode(), tenant.encode()):
        h.update(len(part).to_bytes(4, "little"))  # length-prefixed: ("ab", "c") != ("a", "bc")
        h.update(part)
    return h.digest()


def chunk_keys(token_ids: Sequence[int], chunk_size: int, salt: bytes) -> list[ChunkKey]:
    """One key per chunk of `chunk_size` tokens (the last may be shorter); [] for an empty prefix."""
    if chunk_size <= 0:
        raise BadRequestError(f"chunk_size must be positive, got {chunk_size}")
    ids = np.asarray(token_ids, dtype=np.int64)  # [N]
    if ids.size and (ids.min() < 0 or ids.max() >= 2**32):
        raise BadRequestError("token ids must be in [0, 2**32)")
    words = ids.astype("<u4")  # [N] little-endian uint32
    keys: list[ChunkKey] = []
    prev = bytes(DIGEST_SIZE)
    for index, start in enumerate(range(0, len(words), chunk_size)):
        end = min(start + chunk_size, len(words))
        h = hashlib.blake2b(digest_size=DIGEST_SIZE, key=salt)
        h.update(prev)
        h.update(words[start:end].tobytes())
        prev = h.digest()
        keys.append(ChunkKey(digest=prev, index=index, token_start=start, token_end=end))
    return keys


def object_name(key: ChunkKey, kind: str, layer_start: int, layer_end: int) -> str:
    """The store name of a chunk object: safe for filesystems and Redis."""
    name = f"{key.hex}.{kind}.L{layer_start}-{layer_end}"
    if not _NAME_OK.match(name):
        raise BadRequestError(f"invalid chunk object name {name!r}")
    return name


def valid_name(name: str) -> bool:
    """Whether `name` may name a stored object (no path separators, bounded length)."""
    return bool(_NAME_OK.match(name)) and name not in (".", "..")
