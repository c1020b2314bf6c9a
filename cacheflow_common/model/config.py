"""Model configuration parsed from a Hugging Face `config.json` (Llama, Qwen2, Qwen3, Qwen3-MoE)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cacheflow_common.errors import ConfigError

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    theta: float
    scaling: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    num_experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_step: int
    mlp_only_layers: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    moe: MoeConfig | None = None
    dtype: str = "float32"

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        family = d.get("model_type")
        if family not in FAMILIES:
            raise ConfigError(f"unsupported model_type {family!r}; supported: {', '.join(FAMILIES)}")
        if d.get("mlp_bias"):
            raise ConfigError("MLP biases (mlp_bias: true) are not supported")
        if d.get("use_sliding_window"):
            raise ConfigError("sliding-window attention is not supported (use_sliding_window is true)")
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            return cls(
                family=family,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=_rope(d),
                max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
                qk_norm=family in ("qwen3", "qwen3_moe"),
                moe=_moe(d) if family == "qwen3_moe" else None,
                dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),
            )
        except KeyError as exc:
            raise ConfigError(f"model config lacks required key {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"model config has an invalid value: {exc}") from exc

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            return cls.from_hf_dict(json.loads(file.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read {file}: {exc}") from exc

    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "model_type": self.family,
            "architectures": [FAMILIES[self.family]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "dtype": self.dtype,
            "rope_theta": self.rope.theta,
            "rope_parameters": _rope_parameters(self.rope),
        }
        if self.rope.scaling != "default":
            d["rope_scaling"] = _rope_parameters(self.rope)
        if self.family != "qwen2":
            d["attention_bias"] = self.attention_bias
        if self.moe is not None:
            d.update(num_experts=self.moe.num_experts, num_local_experts=self.moe.num_experts,
                     num_experts_per_tok=self.moe.experts_per_token,
                     moe_intermediate_size=self.moe.intermediate_size, norm_topk_prob=self.moe.norm_topk_prob,
                     decoder_sparse_step=self.moe.sparse_step, mlp_only_layers=list(self.moe.mlp_only_layers))
        return d

    def layer_is_moe(self, layer: int) -> bool:
        m = self.moe
        return (m is not None and m.num_experts > 0 and layer not in m.mlp_only_layers
                and (layer + 1) % m.sparse_step == 0)

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * ITEMSIZE[self.dtype]


def _rope(d: dict[str, Any]) -> RopeConfig:
    """Old style (rope_theta + rope_scaling) or transformers-5 style (rope_parameters)."""
    params = dict(d.get("rope_scaling") or {})
    params.update(d.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ConfigError(f"unsupported rope scaling {kind!r}")
    return RopeConfig(
        theta=theta,
        scaling=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _rope_parameters(rope: RopeConfig) -> dict[str, Any]:
    p: dict[str, Any] = {"rope_type": rope.scaling, "rope_theta": rope.theta}
    if rope.scaling == "linear":
        p["factor"] = rope.factor
    if rope.scaling == "llama3":
        p.update(factor=rope.factor, low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
                 original_max_position_embeddings=rope.original_max_position_embeddings)
    return p


def _moe(d: dict[str, Any]) -> MoeConfig:
    return MoeConfig(
        num_experts=int(d.get("num_experts") or d["num_local_experts"]),
        experts_per_token=int(d["num_experts_per_tok"]),
        intermediate_size=int(d["moe_intermediate_size"]),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        sparse_step=int(d.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(x) for x in d.get("mlp_only_layers", ())),
    )
