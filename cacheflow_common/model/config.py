"""Model configuration for the decoder-only families CacheFlow runs: Llama, Qwen2, Qwen3, Qwen3-MoE.

`ModelConfig.from_hf_dict` reads a Hugging Face `config.json` (both the pre-5 `rope_theta` + `rope_scaling`
style and transformers-5's `rope_parameters`); `to_hf_dict` writes one transformers can load again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cacheflow_common.errors import ConfigError

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
ROPE_SCALINGS = ("default", "linear", "llama3")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    theta: float
    scaling: str  # "default" | "linear" | "llama3"
    factor: float = 1.0  # 1.0: no scaling
    low_freq_factor: float = 1.0  # llama3's published value
    high_freq_factor: float = 4.0  # llama3's published value
    original_max_position_embeddings: int = 8192  # llama3's pretraining context

    def to_hf_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.scaling, "rope_theta": self.theta}
        if self.scaling in ("linear", "llama3"):
            out["factor"] = self.factor
        if self.scaling == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        return out


@dataclass(frozen=True, kw_only=True)
class MoeConfig:
    num_experts: int
    experts_per_token: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_step: int  # decoder_sparse_step
    mlp_only_layers: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe"  (HF model_type)
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
    attention_bias: bool  # qwen2: always True (q/k/v bias); llama/qwen3: config "attention_bias"
    qk_norm: bool  # qwen3 / qwen3_moe: per-head RMSNorm on q and k before RoPE
    moe: MoeConfig | None
    dtype: str  # "float32" | "bfloat16" | "float16": the checkpoint's dtype

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ConfigError(f"unsupported model_type {self.family!r}; supported: {', '.join(FAMILIES)}")
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPE_BYTES)}")
        if self.rope.scaling not in ROPE_SCALINGS:
            raise ConfigError(f"unsupported rope scaling {self.rope.scaling!r}; supported: {', '.join(ROPE_SCALINGS)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if (self.family == "qwen3_moe") != (self.moe is not None):
            raise ConfigError("a MoE config is required for qwen3_moe and only for it")

    # ---------------------------------------------------------------- reading
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        family = d.get("model_type")
        if family not in FAMILIES:
            raise ConfigError(f"unsupported model_type {family!r}; supported: {', '.join(FAMILIES)}")
        if d.get("use_sliding_window"):
            raise ConfigError(f"{family}: sliding-window attention (use_sliding_window=true) is not supported")
        layer_types = d.get("layer_types") or ()  # transformers 5: one attention kind per layer
        if any(kind != "full_attention" for kind in layer_types):
            raise ConfigError(f"{family}: layer_types {sorted(set(layer_types))} are not supported "
                              "(full_attention only)")

        if d.get("mlp_bias"):
            raise ConfigError(f"{family}: mlp_bias=true is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{family}: hidden_act {d['hidden_act']!r} is not supported (SwiGLU with silu only)")

        def need(key: str) -> int:
            if key not in d or d[key] is None:
                raise ConfigError(f"{family} config is missing required key {key!r}")
            return _int(d, key)

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        if heads <= 0:
            raise ConfigError(f"num_attention_heads must be positive, got {heads}")
        kv_heads = _int(d, "num_key_value_heads", heads)  # absent: plain multi-head attention
        head_dim = _int(d, "head_dim", hidden // heads)  # absent: the classic hidden / heads
        moe: MoeConfig | None = None
        if family == "qwen3_moe":
            if d.get("num_experts", d.get("num_local_experts")) is None:
                raise ConfigError("qwen3_moe config is missing required key 'num_experts'")
            exp_key = "num_experts" if d.get("num_experts") is not None else "num_local_experts"
            moe = MoeConfig(
                num_experts=_int(d, exp_key),
                experts_per_token=need("num_experts_per_tok"),
                intermediate_size=need("moe_intermediate_size"),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),  # transformers' default
                sparse_step=_int(d, "decoder_sparse_step", 1),  # transformers' default: every layer
                mlp_only_layers=_int_tuple(d, "mlp_only_layers"),
            )
            if moe.sparse_step <= 0 or not 0 < moe.experts_per_token <= max(moe.num_experts, 1):
                raise ConfigError(f"qwen3_moe: invalid decoder_sparse_step {moe.sparse_step} or "
                                  f"num_experts_per_tok {moe.experts_per_token} (of {moe.num_experts} experts)")
        return cls(
            family=family,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),  # the Qwen/Llama default
            rope=_rope_from_hf(d),
            max_position_embeddings=_int(d, "max_position_embeddings", 32768),  # only informative here
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),  # transformers' default
            attention_bias=True if family == "qwen2" else bool(d.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            moe=moe,
            dtype=str(d.get("dtype") or d.get("torch_dtype") or "float32"),  # absent: weights are fp32
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise ConfigError(f"no config.json in {path}")
        try:
            d = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file} is not valid JSON: {e}") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{file} does not hold a JSON object")
        return cls.from_hf_dict(d)

    # ---------------------------------------------------------------- writing
    def to_hf_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "model_type": self.family,
            "architectures": [ARCHITECTURES[self.family]],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": self.rope.to_hf_dict(),
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "use_sliding_window": False,
            "dtype": self.dtype,
        }
        if self.moe is not None:
            d |= {
                "num_experts": self.moe.num_experts,
                "num_experts_per_tok": self.moe.experts_per_token,
                "moe_intermediate_size": self.moe.intermediate_size,
                "norm_topk_prob": self.moe.norm_topk_prob,
                "decoder_sparse_step": self.moe.sparse_step,
                "mlp_only_layers": list(self.moe.mlp_only_layers),
            }
        return d

    def canonical_json(self) -> str:
        """Stable text of the architecture, for fingerprints: every field except the checkpoint dtype
        (the weights' own dtypes are fingerprinted with the weights)."""
        fields = asdict(self)
        del fields["dtype"]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    # ---------------------------------------------------------------- queries
    def layer_is_moe(self, layer: int) -> bool:
        moe = self.moe
        if moe is None or moe.num_experts <= 0:
            return False
        return layer not in moe.mlp_only_layers and (layer + 1) % moe.sparse_step == 0


def _int(d: dict[str, Any], key: str, default: int | None = None) -> int:
    """d[key] as an int (`default` when absent or null), or a ConfigError naming the key."""
    value = d.get(key)
    if value is None:
        if default is None:
            raise ConfigError(f"config is missing required key {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
    return int(value)


def _float(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
    return float(value)


def _int_tuple(d: dict[str, Any], key: str) -> tuple[int, ...]:
    values = d.get(key) or []
    if not isinstance(values, list | tuple):
        raise ConfigError(f"config key {key!r} must be a list of integers, got {values!r}")
    return tuple(_int({key: v}, key) for v in values)


def _rope_from_hf(d: dict[str, Any]) -> RopeConfig:
    """Both styles: transformers-5 `rope_parameters` (theta inside) or `rope_theta` + optional `rope_scaling`."""
    params = d.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be an object, got {params!r}")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError("rope_parameters nested per layer type are not supported (one RoPE for all layers)")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = params["rope_theta"]
        scaling: dict[str, Any] = params
    else:
        theta = d.get("rope_theta", 10000.0)  # transformers' historical default
        scaling = d.get("rope_scaling") or (params if isinstance(params, dict) else {})
    theta = _float({"rope_theta": theta}, "rope_theta", 10000.0)  # null: transformers' historical default
    partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor {partial} is not supported (RoPE over the whole head only)")
    kind = str(scaling.get("rope_type", scaling.get("type", "default")))
    if kind not in ROPE_SCALINGS:
        raise ConfigError(f"unsupported rope scaling {kind!r}; supported: {', '.join(ROPE_SCALINGS)}")
    if kind in ("linear", "llama3") and "factor" not in scaling:
        raise ConfigError(f"rope scaling {kind!r} needs a 'factor'")
    if kind == "default":  # the scaling fields mean nothing here: keep the defaults so configs compare equal
        return RopeConfig(theta=theta, scaling=kind)
    if kind == "linear":
        return RopeConfig(theta=theta, scaling=kind, factor=float(scaling["factor"]))
    return RopeConfig(
        theta=theta,
        scaling=kind,
        factor=float(scaling["factor"]),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),  # llama3's published value
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),  # llama3's published value
        original_max_position_embeddings=int(
            scaling.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
        ),
    )
