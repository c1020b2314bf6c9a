"""Chunk keys: the blake2b chain, tenant salts, and object names."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from cacheflow_common.errors import BadRequestError
from cacheflow_common.kv.keys import DIGEST_SIZE, ChunkKey, chunk_keys, object_name, tenant_salt, valid_name

SALT = tenant_salt("model-fp", "tenant-a")


def test_same_prefix_gives_same_keys_and_chunks_tile_the_prefix():
    ids = list(range(40))
    keys = chunk_keys(ids, 16, SALT)
    assert [(k.index, k.token_start, k.token_end) for k in keys] == [(0, 0, 16), (1, 16, 32), (2, 32, 40)]
    assert keys[2].n_tokens == 8  # the last chunk is partial
    assert keys == chunk_keys(ids, 16, SALT)
    assert all(len(k.digest) == DIGEST_SIZE and k.hex == k.digest.hex() for k in keys)
    # A longer prefix shares the keys of its common chunks.
    assert chunk_keys([*ids, 7, 7, 7], 16, SALT)[:2] == keys[:2]


def test_keys_follow_the_documented_chain():
    ids = [5, 70000, 2**32 - 1]
    prev = bytes(16)
    for key, chunk in zip(chunk_keys(ids, 2, SALT), ([5, 70000], [2**32 - 1]), strict=True):
        h = hashlib.blake2b(digest_size=16, key=SALT)
        h.update(prev + b"".join(i.to_bytes(4, "little") for i in chunk))
        prev = h.digest()
        assert key.digest == prev


def test_one_changed_token_changes_that_key_and_every_later_one():
    ids = list(range(64))
    keys = chunk_keys(ids, 16, SALT)
    changed = chunk_keys([*ids[:20], 999, *ids[21:]], 16, SALT)
    assert changed[0] == keys[0]
    assert all(a.digest != b.digest for a, b in zip(changed[1:], keys[1:], strict=True))
    # Chaining: the same last-chunk tokens after a different history give a different key.
    assert chunk_keys([1, *ids[1:]], 16, SALT)[3].digest != keys[3].digest


def test_salt_separates_tenants_and_models():
    ids = list(range(40))
    keys = chunk_keys(ids, 16, SALT)
    for other in (tenant_salt("model-fp", "tenant-b"), tenant_salt("other-model", "tenant-a"),
                  tenant_salt("model-fpt", "enant-a")):  # length-prefixed parts: no ambiguity at the seam
        assert other != SALT
        assert all(a.digest != b.digest for a, b in zip(chunk_keys(ids, 16, other), keys, strict=True))
    assert tenant_salt("model-fp", "tenant-a") == SALT and len(SALT) == 16


def test_edge_cases_and_bad_input():
    assert chunk_keys([], 16, SALT) == []
    assert len(chunk_keys([3], 16, SALT)) == 1
    with pytest.raises(BadRequestError):
        chunk_keys([1, 2], 0, SALT)
    with pytest.raises(BadRequestError):
        chunk_keys([1, 2], -4, SALT)
    bad_ids: list[list[Any]] = [[-1], [2**32], [2**70], [1.5], [True]]
    for bad in bad_ids:
        with pytest.raises(BadRequestError):
            chunk_keys(bad, 4, SALT)
    with pytest.raises(BadRequestError):
        chunk_keys([1], 4, bytes(65))
    with pytest.raises(BadRequestError):
        ChunkKey(digest=b"short", index=0, token_start=0, token_end=1)
    with pytest.raises(BadRequestError):
        ChunkKey(digest=bytes(16), index=0, token_start=5, token_end=4)


def test_object_names_are_safe():
    key = chunk_keys(list(range(8)), 4, SALT)[1]
    name = object_name(key, "kv", 0, 4)
    assert name == f"{key.hex}.kv.L0-4" and valid_name(name)
    assert object_name(key, "hidden", 3, 4) == f"{key.hex}.hidden.L3-4"
    for kind in ("../x", "a/b", "KV", ""):
        with pytest.raises(BadRequestError):
            object_name(key, kind, 0, 4)
    with pytest.raises(BadRequestError):
        object_name(key, "kv", 4, 4)


@pytest.mark.parametrize("bad", ["", ".", "..", "...", ".hidden", ".tmp-x", "a/b", "a\\b", "sp ace", "x\n",
                                 "é", "x" * 201])
def test_invalid_names(bad):
    assert not valid_name(bad)


def test_valid_names():
    assert valid_name("a") and valid_name("obj-1") and valid_name("x" * 200) and valid_name("a..b")
