"""Weights: the parameter list of a config, seeded random init, safetensors load/save, fingerprints."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cacheflow_common.errors import ConfigError
from cacheflow_common.model.config import ModelConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
FULL_HASH_LIMIT = 2 << 30  # checkpoints up to 2 GiB are hashed whole; larger ones by sampled windows
_WINDOWS, _WINDOW = 64, 64 * 1024  # 64 windows of 64 KiB per file beyond that limit


def layer_param_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    c, p = config, f"model.layers.{layer}."
    q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (c.hidden_size,),
        p + "post_attention_layernorm.weight": (c.hidden_size,),
        p + "self_attn.q_proj.weight": (q_out, c.hidden_size),
        p + "self_attn.k_proj.weight": (kv_out, c.hidden_size),
        p + "self_attn.v_proj.weight": (kv_out, c.hidden_size),
        p + "self_attn.o_proj.weight": (c.hidden_size, q_out),
    }
    if c.attention_bias:
        shapes.update({p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                       p + "self_attn.v_proj.bias": (kv_out,)})
    if c.qk_norm:
        shapes.update({p + "self_attn.q_norm.weight": (c.head_dim,), p + "self_attn.k_norm.weight": (c.head_dim,)})
    if c.layer_is_moe(layer) and c.moe is not None:
        shapes[p + "mlp.gate.weight"] = (c.moe.num_experts, c.hidden_size)
        for e in range(c.moe.num_experts):
            shapes.update(_mlp_shapes(f"{p}mlp.experts.{e}.", c.hidden_size, c.moe.intermediate_size))
    else:
        shapes.update(_mlp_shapes(p + "mlp.", c.hidden_size, c.intermediate_size))
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {prefix + "gate_proj.weight": (inter, hidden), prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter)}


def param_shapes(config: ModelConfig, layers: range) -> dict[str, tuple[int, ...]]:
    """Every parameter the runtime needs for `layers` (embedding, final norm and head included)."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
                                          "model.norm.weight": (config.hidden_size,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    for layer in layers:
        shapes.update(layer_param_shapes(config, layer))
    return shapes


def random_weights(config: ModelConfig, *, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded: normal(0, 0.02) matrices and biases; norm weights 1 + 0.1 * normal, so norm mistakes show."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in sorted(param_shapes(config, range(config.num_layers)).items()):
        x = torch.randn(shape, generator=gen)
        weights[name] = (1 + 0.1 * x if "norm" in name else 0.02 * x).to(dtype)
    return weights


def load_weights(path: Path, config: ModelConfig, *, layers: range, dtype: torch.dtype,
                 device: torch.device | str) -> dict[str, torch.Tensor]:
    """Read only the tensors `layers` need from a safetensors checkpoint (single file or sharded)."""
    wanted = param_shapes(config, layers)
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name in wanted:
                    weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for name, shape in wanted.items():
        if tuple(weights[name].shape) != shape:
            raise ConfigError(f"tensor {name} has shape {tuple(weights[name].shape)}, config implies {shape}")
    return weights


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(f"no model.safetensors (or sharded index) in {path}")


def save_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def checkpoint_fingerprint(path: Path, config: ModelConfig, dtype: torch.dtype) -> str:
    """Identifies a checkpoint as this runtime uses it (config, runtime dtype, weight bytes).

    Independent of which layers a process loads, so every stage of one model agrees on it. Files
    up to FULL_HASH_LIMIT in total are hashed whole; larger checkpoints hash each file's header and
    size plus evenly spaced windows of its bytes (cheap for 8B+ models; a change outside the windows
    would go unnoticed there).
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(config.to_hf_dict(), sort_keys=True).encode())
    h.update(str(dtype).encode())
    files = safetensors_files(path)
    whole = sum(f.stat().st_size for f in files) <= FULL_HASH_LIMIT
    for file in files:
        size = file.stat().st_size
        h.update(size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            if whole:
                while block := f.read(1 << 20):
                    h.update(block)
                continue
            (header_len,) = struct.unpack("<Q", f.read(8))
            h.update(f.read(header_len))
            for i in range(_WINDOWS):
                f.seek(i * max(0, size - _WINDOW) // max(1, _WINDOWS - 1))
                h.update(f.read(_WINDOW))
    return h.hexdigest()


def random_fingerprint(config: ModelConfig, seed: int, dtype: torch.dtype) -> str:
    """A seeded random model is fully determined by its config, seed and dtype."""
    body = json.dumps({"random": True, "seed": seed, "dtype": str(dtype), "config": config.to_hf_dict()},
                      sort_keys=True)
    return hashlib.blake2b(body.encode(), digest_size=16).hexdigest()
