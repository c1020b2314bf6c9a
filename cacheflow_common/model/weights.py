"""Weights: the parameter list of a config, seeded random init, safetensors load/save, fingerprints."""

from __future__ import annotations

import hashlib
import json
import math
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cacheflow_common.errors import ConfigError
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.fingerprint_cache import cached_fingerprint
from cacheflow_common.model.safetensors_rows import RowReader, SafetensorsRows

FP_BLOCK_BYTES = 64 << 20  # a fingerprint reads a tensor this many bytes at a time
SHARD_INDEX = "model.safetensors.index.json"


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
    located = locate_tensors(path, wanted)
    weights: dict[str, torch.Tensor] = {}
    for file in sorted({located[name] for name in wanted}):
        with safe_open(str(file), framework="pt") as f:
            for name in sorted(n for n in wanted if located[n] == file):
                weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
                if tuple(weights[name].shape) != wanted[name]:
                    raise ConfigError(f"tensor {name} has shape {tuple(weights[name].shape)}, "
                                      f"config implies {wanted[name]}")
    return weights


def locate_tensors(path: Path, wanted: dict[str, tuple[int, ...]]) -> dict[str, Path]:
    """`tensor_files`, checked to hold every tensor in `wanted`."""
    located = tensor_files(path)
    missing = sorted(set(wanted) - set(located))
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    return located


def tensor_files(path: Path) -> dict[str, Path]:
    """Which file holds each tensor: the shard index's weight_map, or the keys of model.safetensors."""
    index = path / SHARD_INDEX
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


def fingerprint(config: ModelConfig, tensors: dict[str, tuple[tuple[int, ...], torch.dtype, RowReader]]) -> str:
    """blake2b-128 over the canonical config, then per tensor (sorted by name) its name, shape, dtype and
    every byte of it in that dtype, read FP_BLOCK_BYTES at a time (never a whole large tensor at once).

    Tensors come as (shape, dtype, row reader), so the same bytes are hashed whether they are in memory
    or read from a checkpoint's files: a model and its saved copy agree.
    """
    h = hashlib.blake2b(digest_size=16)
    h.update(config.canonical_json().encode())
    for name in sorted(tensors):
        shape, dtype, read = tensors[name]
        h.update(f"{name}|{list(shape)}|{str(dtype).removeprefix('torch.')}|".encode())
        rows = shape[0] if shape else 1
        per_block = max(1, FP_BLOCK_BYTES // max(1, math.prod(shape[1:]) * dtype.itemsize))
        for r0 in range(0, rows if math.prod(shape) else 0, per_block):
            # one block alive at a time: the last one is freed before the next is read
            h.update(read(r0, min(rows, r0 + per_block)).contiguous().view(torch.uint8).cpu().numpy().data)
    return h.hexdigest()


def memory_tensors(weights: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype, RowReader]]:
    def reader(t: torch.Tensor) -> RowReader:
        return lambda r0, r1: t[r0:r1]

    return {n: (tuple(t.shape), t.dtype, reader(t)) for n, t in weights.items()}


def checkpoint_fingerprint(path: Path, config: ModelConfig, dtype: torch.dtype) -> str:
    """The fingerprint of the whole checkpoint at `path` computed in `dtype`, from its files (so every stage
    of a model agrees, whichever layers it loaded): hashed once, then kept beside the files."""
    wanted = param_shapes(config, range(config.num_layers))
    located = locate_tensors(path, wanted)
    files = [path / "config.json", *{located[name] for name in wanted}]
    if (path / SHARD_INDEX).is_file():
        files.append(path / SHARD_INDEX)
    variant = str(dtype).removeprefix("torch.")
    return cached_fingerprint(path, files, variant, lambda: _hash_checkpoint(config, wanted, located, dtype))


def _hash_checkpoint(config: ModelConfig, wanted: dict[str, tuple[int, ...]], located: dict[str, Path],
                     dtype: torch.dtype) -> str:
    """Every tensor read with plain reads (`safetensors_rows.py`: the process's memory holds one block at a
    time); one the file holds in another shape or an unknown dtype through safetensors' own slices."""
    with ExitStack() as stack:
        files: dict[Path, SafetensorsRows] = {}
        mapped: dict[Path, Any] = {}
        tensors: dict[str, tuple[tuple[int, ...], torch.dtype, RowReader]] = {}
        for name, shape in wanted.items():
            file = located[name]
            if file not in files:
                files[file] = SafetensorsRows(stack.enter_context(file.open("rb")))
            read = files[file].reader(name, shape, dtype)
            if read is None:
                if file not in mapped:
                    mapped[file] = stack.enter_context(safe_open(str(file), framework="pt"))
                read = _slice_reader(mapped[file].get_slice(name), dtype)
            tensors[name] = (shape, dtype, read)
        return fingerprint(config, tensors)


def _slice_reader(sl: Any, dtype: torch.dtype) -> RowReader:
    return lambda r0, r1: sl[r0:r1].to(dtype)
