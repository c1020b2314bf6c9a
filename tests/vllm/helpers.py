"""What the vLLM tests share: a tiny Qwen3 with seeded random weights saved as safetensors, and running
prompts through vLLM (its own virtual environment) with `cacheflow_services.vllm_connector.drive`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.transformer import Transformer
from cacheflow_services.vllm_connector.drive_process import VLLM_PYTHON as VLLM_PYTHON  # the tests take them from here
from cacheflow_services.vllm_connector.drive_process import run_drive
from cacheflow_services.vllm_connector.drive_process import vllm_env as vllm_env

REPO = Path(__file__).resolve().parents[2]
DRIVE_TIMEOUT_S = 240

TINY_QWEN3 = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 1024, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32,  # a multiple of 32: vLLM's CPU attention runs its `vec` kernel
    "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 16384, "tie_word_embeddings": False,
    "torch_dtype": "float32",
}
# Random weights at the usual 0.02 give near-uniform logits (greedy ties, logprobs that all look alike);
# larger ones give peaked, prompt-dependent outputs, so a wrong KV shows in tokens and logprobs.
WEIGHT_SCALES = {"model.embed_tokens.weight": 50.0, "lm_head.weight": 10.0}
OTHER_SCALE = 4.0


def save_tiny_qwen3(path: Path, *, seed: int = 1, config: dict[str, Any] | None = None) -> Transformer:
    """A seeded random Qwen3 saved as config.json + model.safetensors (what vLLM and CacheFlow both load)."""
    model = Transformer.random(ModelConfig.from_hf_dict(config or TINY_QWEN3), seed=seed, dtype=torch.float32)
    for name, w in model.weights.items():
        if "norm" not in name:
            w.mul_(WEIGHT_SCALES.get(name, OTHER_SCALE))
    model.save(path)
    return Transformer.from_dir(path, dtype=torch.float32)


def drive(spec: dict[str, Any], workdir: Path, name: str, *, timeout_s: float = DRIVE_TIMEOUT_S) -> dict[str, Any]:
    """Run `spec` (see drive.py) in a fresh vLLM process; returns what it wrote (RuntimeError with the log's
    tail if it failed or timed out)."""
    return run_drive(spec, workdir, name, timeout_s=timeout_s).checked()


def read_stats(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
