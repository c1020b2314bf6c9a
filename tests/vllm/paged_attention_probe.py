"""Run inside vLLM's virtual environment (`python -P tests/vllm/paged_attention_probe.py out.json`): restore KV
into a `PagedKV` (vLLM's CPU attention kernel over paged blocks) and into a plain `KVBuffer` (torch's SDPA),
with the same model and tokens, and report how they compare (test_paged_attention.py asserts on it).

No vLLM engine starts: the kernel is called on a cache tensor laid out as vLLM's CPU backend allocates it.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_services.vllm_connector.paged import gather, scatter
from cacheflow_services.vllm_connector.paged_attention import PagedKV

CONFIG = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
          "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False}
BLOCK, CHUNK, N, FIRST = 32, 64, 320, 64  # block size, unit, prefix tokens, vLLM's own hit (not written)
BLOCK_IDS = [7, 2, 9, 0, 4, 11, 3, 8, 1, 10]  # the request's blocks, out of order: 10 x 32 = 320 positions
HOLE = 3 * CHUNK  # a unit that is loaded, not computed: the units after it attend over it


def probe() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Transformer.random(ModelConfig.from_hf_dict(CONFIG), seed=3)
    c = model.config
    tokens = torch.randint(0, c.vocab_size, (N,))
    plain = model.new_kv(range(c.num_layers), N)
    plain_hidden = restore(model, plain, tokens, hole_from=None)
    # vLLM's own KV of [0, FIRST) in its blocks: plain's, scaled by 1 + 1e-6 so that a write over it shows
    caches = {layer: torch.zeros(12, c.num_kv_heads, BLOCK, 2 * c.head_dim) for layer in range(c.num_layers)}
    own = plain.data[:, :, :, :FIRST] * (1 + 1e-6)  # [L, 2, Hkv, FIRST, D]
    for layer, cache in caches.items():
        scatter(cache, "cpu-vec", BLOCK_IDS, BLOCK, 0, own[layer])
    paged = PagedKV(c, layers=range(c.num_layers), capacity=N, dtype=torch.float32, caches=caches,
                    block_ids=BLOCK_IDS, block_size=BLOCK, isa="vec", first_writable=FIRST)
    paged_hidden = restore(model, paged, tokens, hole_from=plain)
    paged.fill_all(N)
    blocks = torch.stack([gather(caches[layer], "cpu-vec", BLOCK_IDS, BLOCK, 0, N) for layer in range(c.num_layers)])
    return {
        "units_compared": len(paged_hidden),
        "max_hidden_diff": max((paged_hidden[s] - plain_hidden[s]).abs().max().item() for s in paged_hidden),
        "max_buffer_diff": (paged.data - plain.data).abs().max().item(),  # [L, 2, Hkv, N, D] both
        "blocks_equal_buffer_past_first": bool(torch.equal(blocks[:, :, :, FIRST:], paged.data[:, :, :, FIRST:])),
        "first_positions_untouched": bool(torch.equal(blocks[:, :, :, :FIRST], own)),
    }


def restore(model: Transformer, kv: KVBuffer, tokens: torch.Tensor, *, hole_from: KVBuffer | None
            ) -> dict[int, torch.Tensor]:
    """Compute the prefix unit by unit into `kv` (each unit's output hidden state, by its start); with
    `hole_from`, the unit at HOLE is copied from it instead, as a load would land it."""
    layers = range(model.config.num_layers)
    hidden = {}
    for start in range(0, N, CHUNK):
        if hole_from is not None and start == HOLE:
            kv.data[:, :, :, start : start + CHUNK] = hole_from.data[:, :, :, start : start + CHUNK]
            continue
        x = model.embed(tokens[start : start + CHUNK])  # [CHUNK, hidden]
        hidden[start] = model.forward_layers(x, layers, [Span(kv, start, CHUNK)])
    return hidden


if __name__ == "__main__":
    with open(sys.argv[1], "w") as f:
        json.dump(probe(), f)
