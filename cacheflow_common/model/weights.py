"""Weights: the parameter list of a config, seeded random init, safetensors load/save, fingerprints."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cacheflow_common.errors import ConfigError
from cacheflow_common.model.config import ModelConfig

FP_WINDOWS = 16  # windows hashed per tensor: enough to catch a different checkpoint, cheap for 70B
FP_WINDOW = 4096  # bytes per window


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


def random_weights(config: ModelConfig, *, seed: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Seeded: normal(0, 0.02) matrices and biases; norm weights 1 + 0.1 * normal, so norm mistakes show.

    Drawn on `device` (an 8B model's weights are drawn in seconds on a GPU, minutes on a CPU); the same
    seed gives different weights on different device types.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in sorted(param_shapes(config, range(config.num_layers)).items()):
        x = torch.randn(shape, generator=gen, device=device)
        weights[name] = (1 + 0.1 * x if "norm" in name else 0.02 * x).to(dtype)
    return weights


def load_weights(path: Path, config: ModelConfig, *, layers: range, dtype: torch.dtype,
                 device: torch.device | str) -> dict[str, torch.Tensor]:
    """Read only the tensors `layers` need from a safetensors checkpoint (single file or sharded)."""
    wanted = param_shapes(config, layers)
    located = tensor_files(path)
    missing = sorted(set(wanted) - set(located))
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    weights: dict[str, torch.Tensor] = {}
    for file in sorted({located[name] for name in wanted}):
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(n for n in wanted if located[n] == file):
                weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
                if tuple(weights[name].shape) != wanted[name]:
                    raise ConfigError(f"tensor {name} has shape {tuple(weights[name].shape)}, "
                                      f"config implies {wanted[name]}")
    return weights


def tensor_files(path: Path) -> dict[str, Path]:
    """Which file holds each tensor: the shard index's weight_map, or the keys of model.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a valid shard index: {e}") from e
        return {name: path / shard for name, shard in weight_map.items()}
    single = path / "model.safetensors"
    if not single.is_file():
        raise ConfigError(f"no model.safetensors (or sharded index) in {path}")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def save_weights(path: Path, weights: dict[str, torch.Tensor]) -> None:
    save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


# ------------------------------------------------------------------ fingerprints
RowReader = Callable[[int, int], torch.Tensor]  # (first row, end row) -> those rows, in the runtime dtype


def fingerprint(config: ModelConfig, tensors: dict[str, tuple[tuple[int, ...], torch.dtype, RowReader]]) -> str:
    """blake2b-128 over the canonical config, then per tensor (sorted by name) its name, shape, dtype and
    up to FP_WINDOWS evenly spaced FP_WINDOW-byte windows of its bytes (all of them when it is small).

    Tensors come as (shape, dtype, row reader) so a stage that loaded only some layers can fingerprint the
    whole checkpoint by reading a few rows of the others: every stage of one model agrees.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(config.canonical_json().encode())
    for name in sorted(tensors):
        shape, dtype, read = tensors[name]
        h.update(f"{name}|{list(shape)}|{str(dtype).removeprefix('torch.')}|".encode())
        for a, b in _windows(shape, dtype):
            rows = max(1, math.prod(shape[1:]))  # elements per row
            r0, r1 = a // rows, -(-b // rows)
            flat = read(r0, r1).reshape(-1)[a - r0 * rows: b - r0 * rows]  # [b - a]
            h.update(flat.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _windows(shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple[int, int]]:
    """Element ranges to hash: the whole tensor if it fits in FP_WINDOWS windows, else evenly spaced ones."""
    n, per = math.prod(shape), max(1, FP_WINDOW // dtype.itemsize)
    if n <= FP_WINDOWS * per:
        return [(0, n)] if n else []
    return [(a, a + per) for a in (i * (n - per) // (FP_WINDOWS - 1) for i in range(FP_WINDOWS))]


def memory_tensors(weights: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype, RowReader]]:
    def reader(t: torch.Tensor) -> RowReader:
        return lambda r0, r1: t[r0:r1]

    return {n: (tuple(t.shape), t.dtype, reader(t)) for n, t in weights.items()}


def checkpoint_fingerprint(path: Path, config: ModelConfig, dtype: torch.dtype,
                           loaded: dict[str, torch.Tensor]) -> str:
    """The fingerprint the full model would have in `dtype`, reading only sampled rows of unloaded tensors."""
    located = tensor_files(path)
    tensors = memory_tensors(loaded)
    with ExitStack() as stack:
        opened: dict[Path, Any] = {}
        for name, shape in param_shapes(config, range(config.num_layers)).items():
            if name in tensors:
                continue
            file = located[name]
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(str(file), framework="pt"))
            tensors[name] = (shape, dtype, _slice_reader(opened[file].get_slice(name), dtype))
        return fingerprint(config, tensors)


def _slice_reader(sl: Any, dtype: torch.dtype) -> RowReader:
    return lambda r0, r1: sl[r0:r1].to(dtype)
