"""Chunk keys: a blake2b chain over the previous key and each chunk's token ids, salted per model and tenant.

Chunk `i`'s key identifies the whole prefix up to the end of chunk `i`, so equal keys mean equal
prefixes (and the key digest sits in every stored section, so a ranged read is checked against it).
The salt mixes the model fingerprint and the tenant: a tenant can never name another tenant's chunks.

    key_i = blake2b(digest_size=16, key=salt)(key_{i-1} || token ids of chunk i as little-endian uint32)
    key_{-1} = 16 zero bytes
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cacheflow_common.errors import BadRequestError

DIGEST_SIZE = 16  # 128-bit keys: collisions are out of reach for any realistic number of chunks
MAX_SALT = 64  # blake2b's longest key
_KEY_DOMAIN = b"cacheflow/chunk-key/v1"  # separates these salts from any other use of blake2b on the same inputs
_NAME_MAX = 200  # well under every filesystem's 255-byte name limit, and short for Redis
# Object names: filesystem- and Redis-safe. No leading dot: no ".", "..", "...", hidden or temp-file names
# (a "..." object would otherwise shard into the directory ".." and escape the store's root).
_NAME_OK = re.compile(rf"[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{_NAME_MAX - 1}}}")  # used with fullmatch
_KIND_OK = re.compile(r"[a-z][a-z0-9_]{0,15}")  # used with fullmatch


@dataclass(frozen=True)
class ChunkKey:
    """The key of the chunk holding tokens [token_start, token_end) of a prefix."""

    digest: bytes  # DIGEST_SIZE bytes
    index: int  # chunk number within its prefix
    token_start: int
    token_end: int

    def __post_init__(self) -> None:
        if len(self.digest) != DIGEST_SIZE:
            raise BadRequestError(f"a chunk key digest has {DIGEST_SIZE} bytes, got {len(self.digest)}")
        if not 0 <= self.token_start <= self.token_end < 2**32:
            raise BadRequestError(f"bad chunk token range [{self.token_start}, {self.token_end})")

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def n_tokens(self) -> int:
        return self.token_end - self.token_start


def tenant_salt(model_fingerprint: str, tenant: str) -> bytes:
    """The salt of every key of `tenant` on the model `model_fingerprint` (16 bytes)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for part in (_KEY_DOMAIN, model_fingerprint.encode(), tenant.encode()):
        h.update(len(part).to_bytes(4, "little"))  # length-prefixed: ("ab", "c") != ("a", "bc")
        h.update(part)
    return h.digest()


def _token_words(token_ids: Sequence[int]) -> np.ndarray:
    """Token ids -> [N] little-endian uint32; BadRequestError unless they are integers in [0, 2**32)."""
    try:
        ids = np.asarray(token_ids)  # [N]
    except (OverflowError, ValueError) as exc:
        raise BadRequestError(f"token ids must be integers in [0, 2**32): {exc}") from exc
    if ids.size == 0:
        return np.zeros(0, dtype="<u4")
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise BadRequestError(f"token ids must be a flat sequence of integers, got {ids.dtype} of shape {ids.shape}")
    if int(ids.min()) < 0 or int(ids.max()) >= 2**32:
        raise BadRequestError("token ids must be in [0, 2**32)")
    return ids.astype("<u4")  # [N]


def chunk_keys(token_ids: Sequence[int], chunk_size: int, salt: bytes) -> list[ChunkKey]:
    """One key per chunk of `chunk_size` tokens (the last may be shorter); [] for an empty prefix."""
    if chunk_size <= 0:
        raise BadRequestError(f"chunk_size must be positive, got {chunk_size}")
    if len(salt) > MAX_SALT:
        raise BadRequestError(f"a salt has at most {MAX_SALT} bytes, got {len(salt)}")
    words = _token_words(token_ids)  # [N] <u4
    keys: list[ChunkKey] = []
    prev = bytes(DIGEST_SIZE)
    for index, start in enumerate(range(0, len(words), chunk_size)):
        end = min(start + chunk_size, len(words))
        h = hashlib.blake2b(prev, digest_size=DIGEST_SIZE, key=salt)
        h.update(words[start:end].tobytes())
        prev = h.digest()
        keys.append(ChunkKey(digest=prev, index=index, token_start=start, token_end=end))
    return keys


@dataclass(frozen=True)
class HeadRange:
    """KV heads [start, stop) of a model's `total`: the part of each layer's KV a tensor-parallel rank holds."""

    start: int
    stop: int
    total: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop <= self.total:
            raise BadRequestError(f"invalid KV head range [{self.start}, {self.stop}) of {self.total}")

    @property
    def count(self) -> int:
        return self.stop - self.start

    @property
    def whole(self) -> bool:
        return self.count == self.total

    @classmethod
    def of_rank(cls, total: int, tp_size: int, tp_rank: int) -> HeadRange:
        """The KV heads tensor-parallel rank `tp_rank` of `tp_size` holds, as vLLM splits them: a 1/tp_size share
        each, or (more ranks than heads) one head, shared by tp_size / total ranks."""
        if tp_size <= total:
            if total % tp_size:
                raise BadRequestError(f"{total} KV heads do not split over {tp_size} ranks")
            share = total // tp_size
            return cls(tp_rank * share, (tp_rank + 1) * share, total)
        if tp_size % total:
            raise BadRequestError(f"{tp_size} ranks do not share {total} KV heads evenly")
        head = tp_rank // (tp_size // total)
        return cls(head, head + 1, total)

    def parts(self, n: int) -> list[HeadRange]:
        """The model's heads split into `n` equal runs (`n` divides `total`)."""
        share = self.total // n
        return [HeadRange(i * share, (i + 1) * share, self.total) for i in range(n)]


def object_name(key: ChunkKey, kind: str, layer_start: int, layer_end: int, heads: HeadRange | None = None) -> str:
    """The store name of a chunk object, e.g. "<32 hex>.kv.L0-4", or "<32 hex>.kv.L0-4.H2-4" for KV heads [2, 4)
    of a model's (no suffix: all its heads): safe for filesystems and Redis."""
    if not _KIND_OK.fullmatch(kind):
        raise BadRequestError(f"invalid chunk kind {kind!r}")
    if not 0 <= layer_start < layer_end:
        raise BadRequestError(f"invalid layer range [{layer_start}, {layer_end})")
    base = f"{key.hex}.{kind}.L{layer_start}-{layer_end}"
    return base if heads is None or heads.whole else f"{base}.H{heads.start}-{heads.stop}"


def valid_name(name: str) -> bool:
    """Whether `name` may name a stored object: [A-Za-z0-9._-], no leading dot, at most 200 characters."""
    return _NAME_OK.fullmatch(name) is not None
