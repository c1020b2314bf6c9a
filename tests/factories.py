"""Small factories for tests: tiny seeded random models of each family (no download needed)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from cacheflow_common.model.config import ModelConfig, MoeConfig, RopeConfig
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.store.memory import MemoryStore

# Rough costs for the tiny model: good enough to plan with; correctness never depends on them.
TINY_COSTS = CostModel(
    chunk_compute=LinearCost(fixed_s=2e-4, per_token_s=2e-6, per_token_ctx_s=1e-9),
    layer_compute=LinearCost(fixed_s=2e-4, per_token_s=2e-6, per_token_ctx_s=1e-9),
    load=LoadCost(bytes_per_s=2e8, latency_s=5e-5),
)


def tiny_config(family: str = "qwen3", **overrides: Any) -> ModelConfig:
    """A tiny config of `family` with GQA (4 query / 2 KV heads); override any ModelConfig field."""
    base = ModelConfig(
        family=family,
        vocab_size=384,
        hidden_size=96,
        intermediate_size=160,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        head_dim=24,
        rms_norm_eps=1e-6,
        rope=RopeConfig(theta=10000.0, scaling="default"),  # the classic base
        max_position_embeddings=4096,
        tie_word_embeddings=family == "qwen2",
        attention_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
        moe=MoeConfig(num_experts=4, experts_per_token=2, intermediate_size=48, norm_topk_prob=True,
                      sparse_step=1, mlp_only_layers=(1,)) if family == "qwen3_moe" else None,
        dtype="float32",
    )
    return replace(base, **overrides)


def tiny_model(family: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
               **overrides: Any) -> Transformer:
    return Transformer.random(tiny_config(family, **overrides), seed=seed, dtype=dtype, device=device)


def greedy_reference(model: Transformer, ids: list[int], n_new: int) -> tuple[torch.Tensor, list[int]]:
    """One-process greedy generation: the prompt's KV [L, 2, Hkv, P, D] and the `n_new` tokens generated."""
    kv = model.new_kv(range(model.config.num_layers), len(ids) + n_new)
    hidden = model.forward_layers(model.embed(torch.tensor(ids)), model.layers, [Span(kv, 0, len(ids))])
    tokens = [int(model.logits(hidden[-1:]).argmax())]
    for position in range(len(ids), len(ids) + n_new - 1):
        hidden = model.forward_layers(model.embed(torch.tensor(tokens[-1:])), model.layers, [Span(kv, position, 1)])
        tokens.append(int(model.logits(hidden).argmax()))
    return kv.data[:, :, :, : len(ids)], tokens


class CountingStore(MemoryStore):
    """A store in memory that records the names read from it, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def read(self, name: str) -> bytes | None:
        self.reads.append(name)
        return super().read(name)
