"""Small real chunk objects for storage tests (tiny shapes: no model needed)."""

from __future__ import annotations

import torch

from cacheflow_common.kv.chunk import ChunkLayout, encode_kv_chunk
from cacheflow_common.kv.keys import chunk_keys, object_name, tenant_salt

L0, L1, H, D = 0, 4, 2, 16  # layers [0, 4), 2 KV heads, head_dim 16


def make_chunks(n: int, tokens: int = 32, *, seed: int = 0, tenant: str = "alpha") -> list[tuple[str, bytes]]:
    """`n` chained kv chunk objects of `tokens` tokens each: (object name, bytes)."""
    ids = [(seed * 7919 + i) % 50000 for i in range(n * tokens)]
    keys = chunk_keys(ids, tokens, tenant_salt("test-model", tenant))
    g = torch.Generator().manual_seed(seed)
    out = []
    for key in keys:
        kv = torch.randn(L1 - L0, 2, H, tokens, D, generator=g)  # [L, 2, Hkv, T, D]
        obj = encode_kv_chunk(key=key, token_ids=ids[key.token_start : key.token_end], model="test-model",
                              layer_start=L0, kv=kv, dtype="float32")
        out.append((object_name(key, "kv", L0, L1), bytes(obj)))
    return out


def layout(tokens: int = 32) -> ChunkLayout:
    return ChunkLayout(kind="kv", layer_start=L0, layer_end=L1, n_tokens=tokens, num_kv_heads=H, head_dim=D,
                       dtype="float32")


def big_chunk(megabytes: int, *, seed: int = 0) -> tuple[str, bytes]:
    """One chunk object of about `megabytes` MB (for slow-link and throughput tests)."""
    tokens = megabytes * 1024 * 1024 // ((L1 - L0) * 2 * H * D * 4)
    return make_chunks(1, tokens, seed=seed)[0]

