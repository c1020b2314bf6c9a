"""CacheFlow's runtime over the model vLLM already holds: no second copy of the weights.

`shared_runtime(module, ...)` wraps a loaded vLLM Llama / Qwen2 / Qwen3 module (what vLLM's model runner
holds) as a CacheFlow `Transformer`. Its parameter dict holds vLLM's own tensors (the embedding, the
norms, q_norm / k_norm, the LM head: the same storage, or a view of it where vLLM pads the vocabulary),
and its projections call vLLM's own layers: the fused `qkv_proj` (split into q, k, v as vLLM's attention
splits it), `o_proj` and the MLP (`gate_up_proj`, SiluAndMul, `down_proj`). vLLM's CPU backend packs
those layers' weights for oneDNN and drops the plain tensors, so calling the layers is the only way to
share them there; on a GPU it saves the three GEMMs a q/k/v split of the fused weight would take.
Attention, RoPE and the KV writes are CacheFlow's, as in the separate runtime.

What it does not cover (another architecture, MoE, quantized or LoRA layers, tensor parallelism, a
dtype other than the one CacheFlow computes in) gives a reason instead, and the connector falls back to
CacheFlow's own copy of the weights. No vLLM import: the module is read by its attribute names.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.layers import rms_norm
from cacheflow_common.model.transformer import Span, Transformer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
LINEARS = {"self_attn.qkv_proj": "QKVParallelLinear", "self_attn.o_proj": "RowParallelLinear",
           "mlp.gate_up_proj": "MergedColumnParallelLinear", "mlp.down_proj": "RowParallelLinear"}
UNQUANTIZED = "UnquantizedLinearMethod"


class Unsupported(Exception):
    """The vLLM module is not one the shared runtime covers; the message says why."""


class SharedTransformer(Transformer):
    """A `Transformer` whose decoder layers run vLLM's projection layers (`layers[i]`: vLLM's decoder
    layer i) and whose parameter dict holds vLLM's tensors; everything else is the base class's."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], vllm_layers: Sequence[Any], *,
                 source: Path | None, device: torch.device) -> None:
        super().__init__(config, weights, layers=range(config.num_layers), source=source, device=device)
        self.vllm_layers = list(vllm_layers)

    def _layer(self, layer: int, x: torch.Tensor, spans: Sequence[Span], rows: Sequence[int]) -> torch.Tensor:
        c, w, p = self.config, self.weights, f"model.layers.{layer}."
        mod = self.vllm_layers[layer]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)  # [R, hidden]
        qkv, _ = mod.self_attn.qkv_proj(h)  # [R, (H + 2 Hkv) * D], vLLM's fused layout: q | k | v
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # [R, H*D], [R, Hkv*D], [R, Hkv*D]
        out = torch.empty_like(q)  # [R, H*D]
        for span, r0 in zip(spans, rows, strict=True):
            r1 = r0 + span.length
            out[r0:r1] = self._attend(layer, span, q[r0:r1], k[r0:r1], v[r0:r1])
        attn, _ = mod.self_attn.o_proj(out)  # [R, hidden]
        x = x + attn
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        mlp: torch.Tensor = mod.mlp(h)  # [R, hidden]: gate_up_proj, SiluAndMul, down_proj
        return x + mlp


def shared_runtime(module: Any, config: ModelConfig, *, dtype: torch.dtype,
                   source: Path | None) -> SharedTransformer:
    """CacheFlow's runtime over vLLM's loaded `module` (its `...ForCausalLM`); `source` is the checkpoint
    directory (the fingerprint is hashed from its files, as the separate runtime's is). Unsupported says
    why a module is not covered."""
    try:
        check_module(module, config, dtype)
    except AttributeError as exc:  # a module of the right name but another structure
        raise Unsupported(f"vLLM's {type(module).__name__} is not laid out as expected: {exc}") from exc
    inner = module.model
    device = inner.embed_tokens.weight.device
    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _rows(inner.embed_tokens.weight, config.vocab_size),
        "model.norm.weight": inner.norm.weight,
    }
    if not config.tie_word_embeddings:
        weights["lm_head.weight"] = _rows(module.lm_head.weight, config.vocab_size)
    for i, layer in enumerate(inner.layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        weights[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        if config.qk_norm:
            weights[p + "self_attn.q_norm.weight"] = layer.self_attn.q_norm.weight
            weights[p + "self_attn.k_norm.weight"] = layer.self_attn.k_norm.weight
    weights = {name: t.data for name, t in weights.items()}  # plain tensors over the parameters' storage
    return SharedTransformer(config, weights, list(inner.layers), source=source, device=device)


def _rows(weight: torch.Tensor, n: int) -> torch.Tensor:
    """The first `n` rows (vLLM pads the vocabulary to a multiple of 64): a view, never a copy."""
    return weight if weight.shape[0] == n else weight[:n]


def check_module(module: Any, config: ModelConfig, dtype: torch.dtype) -> None:
    """Unsupported unless `module` is an unquantized, unsharded vLLM model of `config`'s family in `dtype`."""
    arch = ARCHITECTURES.get(config.family)
    if arch is None:
        raise Unsupported(f"model family {config.family!r} (the shared runtime covers {sorted(ARCHITECTURES)})")
    if type(module).__name__ != arch:
        raise Unsupported(f"vLLM's model is a {type(module).__name__}, not the {arch} the config implies")
    inner = module.model
    layers = list(getattr(inner, "layers", ()))
    if len(layers) != config.num_layers:
        raise Unsupported(f"vLLM's model holds {len(layers)} decoder layers, the config {config.num_layers} "
                          "(pipeline parallelism is not covered)")
    embed = inner.embed_tokens.weight
    if embed.dtype != dtype:
        raise Unsupported(f"vLLM's weights are {embed.dtype}, CacheFlow computes in {dtype}")
    if embed.shape[0] < config.vocab_size or embed.shape[1] != config.hidden_size:
        raise Unsupported(f"vLLM's embedding is {tuple(embed.shape)} for vocab {config.vocab_size} "
                          f"(tensor parallelism is not covered)")
    for i, layer in enumerate(layers):
        _check_layer(i, layer, config)


def _check_layer(i: int, layer: Any, config: ModelConfig) -> None:
    attn = layer.self_attn
    if (attn.q_size, attn.kv_size) != (config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim):
        raise Unsupported(f"layer {i}: vLLM's attention has q/kv sizes {attn.q_size}/{attn.kv_size} "
                          "(tensor parallelism is not covered)")
    for name, cls in LINEARS.items():
        linear = layer.get_submodule(name)
        if type(linear).__name__ != cls:
            raise Unsupported(f"layer {i}: {name} is a {type(linear).__name__}, not {cls} (LoRA or MoE?)")
        method = type(getattr(linear, "quant_method", None)).__name__
        if method != UNQUANTIZED:
            raise Unsupported(f"layer {i}: {name} runs {method} (quantized layers are not covered)")
    if config.qk_norm and not (hasattr(attn, "q_norm") and hasattr(attn, "k_norm")):
        raise Unsupported(f"layer {i}: vLLM's attention has no q_norm / k_norm")


def shared_bytes(model: Transformer, module: Any) -> tuple[int, int]:
    """(bytes of `model`'s tensors inside `module`'s parameters' storage, bytes outside it): what the
    runtime shares with vLLM and what it adds."""
    storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    inside = outside = 0
    for t in model.weights.values():
        n = t.numel() * t.element_size()
        if t.untyped_storage().data_ptr() in storages:
            inside += n
        else:
            outside += n
    return inside, outside
