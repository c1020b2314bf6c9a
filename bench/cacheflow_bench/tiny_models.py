"""Tiny random checkpoints of the model families vLLM users run, built locally (no download) with
transformers' own model classes and saved as config.json + model.safetensors, plus an FP8-weight variant,
two families with a multi-token-prediction layer (MiMo, GLM-4.5) and a tiny random LoRA adapter
(adapter_config.json + adapter_model.safetensors).

Every model: hidden 128, 2 layers, 4 query / 2 KV heads of 32 dims (vLLM's CPU attention runs its `vec`
kernel on multiples of 32), vocab 1024, float32; DeepSeek-V2's MLA latent is 256 + 64 rope dims (vLLM's MLA
takes 320, 512 or 576). Random weights at the usual 0.02 give near-uniform logits
(greedy ties); larger ones (`STD`, `FAMILY_STD`) give peaked outputs that depend on the whole prompt, so a
wrong KV shows in the tokens.

    python -m cacheflow_bench.tiny_models FAMILY DIR
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

VOCAB = 1024
BASE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}
YARN = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 1024}
# family -> (Hugging Face model_type, settings over BASE)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {**MOE, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "mistral": ("mistral", {"sliding_window": None}),
    "gemma2": ("gemma2", {"sliding_window": 128, "query_pre_attn_scalar": 32, "tie_word_embeddings": True,
                          "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "phi3": ("phi3", {"head_dim": None}),  # phi3 derives it: 128 / 4 = 32
    "granite": ("granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "logits_scaling": 8.0,
                            "attention_multiplier": 0.03}),
    "deepseek_v2": ("deepseek_v2", {"head_dim": None, "num_key_value_heads": 4, "kv_lora_rank": 256,
                                    "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 64,
                                    "v_head_dim": 64, "n_routed_experts": 4, "num_experts_per_tok": 2,
                                    "n_shared_experts": 1, "moe_intermediate_size": 64, "first_k_dense_replace": 1,
                                    "n_group": 1, "topk_group": 1}),
    "qwen3_yarn": ("qwen3", {"rope_parameters": YARN}),
    # one sliding-window layer, then one global one, each with its own rope base
    "gemma3": ("gemma3_text", {"sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"],
                               "query_pre_attn_scalar": 32, "tie_word_embeddings": True}),
    "glm4": ("glm4", {}),  # half the head's dims rotated, biased q/k/v, norms after attention and MLP too
    # FP8 weights with block scales (see `to_fp8`); 64-dim heads: o_proj's input split over 2 TP ranks must
    # still hold whole 128-column blocks
    "llama_fp8": ("llama", {"head_dim": 64}),
    # with one multi-token-prediction layer each (`add_mtp_layer`: vLLM's MTP draft): Xiaomi's MiMo (a Qwen2),
    # GLM-4.5 (MoE after a dense first layer, shared expert, sigmoid routing, half the head's dims rotated)
    "mimo": ("qwen2", {"num_nextn_predict_layers": 1}),
    "glm4_moe": ("glm4_moe", {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                              "moe_intermediate_size": 64, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                              "partial_rotary_factor": 0.5, "attention_bias": True, "num_nextn_predict_layers": 1}),
}
FP8_FAMILIES = {"llama_fp8"}
# the dtype vLLM runs a family in where float32 is refused on its CPU build: fp8 quantization ("torch.float32
# is not supported for quantization method fp8"), DeepSeek's MLA / MoE kernels ("expect weight to be bfloat16, ...")
RUN_DTYPE = {"llama_fp8": "bfloat16", "deepseek_v2": "bfloat16"}
# standard deviations of the random weights by name; norms keep their initial values
STD = {"embed_tokens": 1.0, "lm_head": 0.2}
OTHER_STD = 0.08
# Families whose embeddings reach the residual stream scaled up (Gemma: by sqrt(hidden), and tied to the
# output; Granite: by `embedding_multiplier`, its layers' outputs scaled down): at STD's 1.0 the last token's
# embedding decides every greedy token, so no KV (right or wrong) would change them. Smaller ones make the
# tokens depend on the prefix (tests/bench/test_tiny_models.py).
FAMILY_STD = {family: {"embed_tokens": 0.01} for family in ("gemma2", "gemma3", "granite")}
FP8_MAX = 448.0  # float8_e4m3fn
# FP8 weights' scale blocks, [output rows, input columns]: vLLM's CPU kernel (W8A16) takes 128 input
# columns only; every output side here is a multiple of 32
FP8_BLOCK = (32, 128)
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ("q_proj", "v_proj", "qkv_proj", "o_proj")  # the first two a model has are adapted
LORA_RANK = 8
EAGLE_LAYERS = 1  # an EAGLE-1 draft: one decoder layer over [token embedding, target hidden state]
MEDUSA_HEADS = 3  # a Medusa draft: one residual block and LM head per drafted position


def hf_config(family: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    model_type, settings = FAMILIES[family]
    kwargs = {k: v for k, v in {**BASE, **settings, **overrides}.items() if v is not None or k == "sliding_window"}
    return AutoConfig.for_model(model_type, **kwargs)


def build(family: str, seed: int = 0, **overrides: Any) -> Any:
    """The family's transformers model with seeded random weights at `STD` (`overrides`: settings of its
    config)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32)
    stds = {**STD, **FAMILY_STD.get(family, {})}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, next((s for k, s in stds.items() if k in name), OTHER_STD))
    return model


def save(family: str, path: Path, seed: int = 0) -> Path:
    """Save the family's tiny model under `path` (config.json + model.safetensors); returns `path`."""
    model = build(family, seed)
    model.save_pretrained(path, safe_serialization=True)
    if family in FP8_FAMILIES:
        to_fp8(path)
    if family in MTP_FAMILIES:
        add_mtp_layer(path, family)
    return path


def to_fp8(path: Path) -> None:
    """Rewrite a saved checkpoint's decoder linears as float8_e4m3fn with a scale per FP8_BLOCK block
    (`weight_scale_inv`, DeepSeek-V3's layout of vLLM's `fp8` quantization, dynamic activation scales) and
    say so in config.json. (Per-tensor scales fail on vLLM's CPU build: it requantizes fused
    q/k/v with `static_scaled_fp8_quant`, which has no CPU kernel.)"""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for name, w in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in FP8_LINEARS:
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = block_fp8(w)
        else:
            out[name] = w
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(FP8_BLOCK)}
    (path / "config.json").write_text(json.dumps(config, indent=2))


def block_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [out, in] (multiples of FP8_BLOCK) as float8_e4m3fn and its per-block scales."""
    (n, k), (bn, bk) = w.shape, FP8_BLOCK
    blocks = w.float().reshape(n // bn, bn, k // bk, bk)
    scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(w.shape)
    return q, scale


def save_lora(family: str, model_dir: Path, path: Path, seed: int = 1, b_std: float = 0.1) -> Path:
    """A random rank-8 LoRA adapter for the family's tiny model (on the first two of `LORA_TARGETS` it has,
    every layer), saved as PEFT writes one; B is random too (`b_std`), so the adapter changes the outputs."""
    from safetensors.torch import save_file

    model = build(family)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    targets = [t for t in LORA_TARGETS if any(n.endswith(f".{t}") for n in linears)][:2]
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, m in linears.items():
        if name.rsplit(".", 1)[-1] in targets:
            tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(LORA_RANK, m.in_features, generator=gen)
            tensors[f"base_model.model.{name}.lora_B.weight"] = b_std * torch.randn(m.out_features, LORA_RANK,
                                                                                  generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK,
              "lora_dropout": 0.0, "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
              "modules_to_save": None, "base_model_name_or_path": str(model_dir)}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def save_eagle(family: str, path: Path, seed: int = 2) -> Path:
    """A random EAGLE-1 draft for the family's tiny model (`eagle_from`)."""
    return eagle_from(build(family, seed), path, seed)


def eagle_from(draft: Any, path: Path, seed: int = 2) -> Path:
    """An EAGLE-1 draft made of a transformers model's first layer, as vLLM's `EagleLlamaForCausalLM` reads one:
    its config with one layer, a random `fc` (2 hidden -> hidden) and that layer's weights (no input norm),
    named without the `model.` prefix; the embedding and LM head come from the target."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    hidden = draft.config.hidden_size
    tensors = {name.removeprefix("model."): w.detach().clone() for name, w in draft.state_dict().items()
               if name.startswith("model.layers.") and int(name.split(".")[2]) < EAGLE_LAYERS
               and not name.startswith("model.layers.0.input_layernorm")}  # EAGLE's first layer has none
    tensors["fc.weight"] = OTHER_STD * torch.randn(hidden, 2 * hidden, generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = {**draft.config.to_dict(), "num_hidden_layers": EAGLE_LAYERS, "architectures": ["EagleLlamaForCausalLM"]}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def save_copying_eagle(target: Path, draft: Path, seed: int = 0) -> tuple[Path, Path]:
    """A one-layer tiny Llama and an EAGLE-1 draft that copies it, so the draft's tokens are the target's
    and vLLM accepts nearly all of them — if, and only if, the draft's KV is right.

    The draft's layer is the target's (without the input norm EAGLE's first layer lacks); its `fc` passes the
    token embedding through and drops the target's hidden state. The target's embedding rows have an RMS of 1
    and its norms weigh 1, so its input norm leaves an embedding as it is, and its final norm only scales the
    output (the argmax is the draft's, which has none). The draft at position i reads token i + 1, as the
    target does at i + 1, and RoPE sees the same distances: both attend alike, but for the prompt's first
    token, which the draft never reads."""
    from safetensors.torch import save_file

    model = copied_target("llama", seed)
    model.save_pretrained(target, safe_serialization=True)
    hidden = model.config.hidden_size
    tensors = {name.removeprefix("model."): w.detach().clone() for name, w in model.state_dict().items()
               if name.startswith("model.layers.0.") and "input_layernorm" not in name}
    tensors["fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)  # [hidden, 2 hidden]
    draft.mkdir(parents=True, exist_ok=True)
    save_file(tensors, draft / "model.safetensors", metadata={"format": "pt"})
    config = {**model.config.to_dict(), "architectures": ["EagleLlamaForCausalLM"]}
    (draft / "config.json").write_text(json.dumps(config, indent=2))
    return target, draft


def copied_target(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A one-layer tiny model of `family` whose embedding rows have an RMS of 1 (its input norm leaves them as
    they are): a draft made of its layer computes at position i what it computes at i + 1."""
    model = build(family, seed, num_hidden_layers=1, **overrides)
    with torch.no_grad():
        embed = model.model.embed_tokens.weight  # [vocab, hidden]
        embed /= embed.pow(2).mean(dim=-1, keepdim=True).sqrt()
    return model


@dataclass(frozen=True)
class MtpLayout:
    """How a family's checkpoint holds its multi-token-prediction layer: under `prefix` ("{layers}": the
    target's layer count) a decoder layer, a norm of the next token's embedding and one of the target's output
    row, a projection of the two side by side (2 hidden -> hidden) and a final norm; vLLM shares the target's
    embedding and LM head with it."""

    architecture: str
    prefix: str
    embedding_norm: str
    row_norm: str
    projection: str
    final_norm: str
    embedding_first: bool  # the projection reads [embedding, row] (else [row, embedding])


MTP_LAYOUTS = {
    "mimo": MtpLayout("MiMoForCausalLM", "model.mtp_layers.0.", "token_layernorm", "hidden_layernorm", "input_proj",
                      "final_layernorm", embedding_first=False),
    "glm4_moe": MtpLayout("Glm4MoeForCausalLM", "model.layers.{layers}.", "enorm", "hnorm", "eh_proj",
                          "shared_head.norm", embedding_first=True),
}
MTP_FAMILIES = set(MTP_LAYOUTS)
COPYING_SETTINGS = {"glm4_moe": {"first_k_dense_replace": 0}}  # the copied layer is MoE, as the MTP layer is


def add_mtp_layer(path: Path, family: str, *, copying: bool = False, seed: int = 5) -> Path:
    """Give `family`'s checkpoint saved at `path` one multi-token-prediction layer as the family's checkpoints
    hold it (`MTP_LAYOUTS`; vLLM serves it with `"method": "mtp"`): its decoder layer a copy of the target's last,
    its norms as the target's, its projection random. `copying`: the projection passes the embedding through and
    drops the row, so over a `copied_target` the layer drafts the target's own tokens (`save_copying_eagle`'s
    argument; vLLM zeroes the embedding at position 0)."""
    from safetensors.torch import load_file, save_file

    layout = MTP_LAYOUTS[family]
    tensors = load_file(path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    last = f"model.layers.{layers - 1}."
    layer = {name.removeprefix(last): w for name, w in tensors.items() if name.startswith(last)}
    if copying:
        halves = [torch.eye(hidden), torch.zeros(hidden, hidden)]  # [embedding, row]
        proj = torch.cat(halves if layout.embedding_first else halves[::-1], dim=1)  # [hidden, 2 hidden]
    else:
        proj = OTHER_STD * torch.randn(hidden, 2 * hidden, generator=torch.Generator().manual_seed(seed))
    extra = {layout.projection: proj, layout.final_norm: tensors["model.norm.weight"],
             layout.embedding_norm: torch.ones(hidden), layout.row_norm: torch.ones(hidden)}
    prefix = layout.prefix.format(layers=layers)
    tensors |= {prefix + name: w.clone() for name, w in layer.items()}
    tensors |= {f"{prefix}{name}.weight": w.clone() for name, w in extra.items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config |= {"architectures": [layout.architecture], "num_nextn_predict_layers": 1}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def save_copying_mtp(family: str, path: Path, seed: int = 0) -> Path:
    """A one-layer tiny model of `family` (MTP_LAYOUTS) whose MTP layer drafts its own greedy tokens
    (`add_mtp_layer`, copying)."""
    copied_target(family, seed, **COPYING_SETTINGS.get(family, {})).save_pretrained(path, safe_serialization=True)
    return add_mtp_layer(path, family, copying=True)


EAGLE3_AUX_LAYERS = (0, 1, 2)  # the tiny models' residual streams an EAGLE-3 draft reads: entering each layer, then out


def save_eagle3(family: str, path: Path, seed: int = 4) -> Path:
    """A random EAGLE-3 draft for the family's tiny model, as vLLM's `Eagle3LlamaForCausalLM` reads one: one
    layer (`midlayer`) whose attention takes [token embedding, hidden] (2 hidden wide), `fc` from the target's
    residual streams entering EAGLE3_AUX_LAYERS (3 hidden -> hidden), its own final norm and LM head; the
    embedding comes from the target."""
    from safetensors.torch import save_file

    config = hf_config(family)
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim, inner = config.head_dim, config.intermediate_size
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return OTHER_STD * torch.randn(*shape, generator=gen)

    layer = {"self_attn.q_proj": rand(heads * head_dim, 2 * hidden),  # over [embedding, hidden]
             "self_attn.k_proj": rand(kv_heads * head_dim, 2 * hidden),
             "self_attn.v_proj": rand(kv_heads * head_dim, 2 * hidden),
             "self_attn.o_proj": rand(hidden, heads * head_dim),
             "mlp.gate_proj": rand(inner, hidden), "mlp.up_proj": rand(inner, hidden),
             "mlp.down_proj": rand(hidden, inner), "input_layernorm": torch.ones(hidden),
             "hidden_norm": torch.ones(hidden), "post_attention_layernorm": torch.ones(hidden)}
    tensors = {f"midlayer.{name}.weight": w for name, w in layer.items()}
    tensors |= {"fc.weight": rand(hidden, len(EAGLE3_AUX_LAYERS) * hidden), "norm.weight": torch.ones(hidden),
                "lm_head.weight": STD["lm_head"] * torch.randn(config.vocab_size, hidden, generator=gen)}
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    draft = {**config.to_dict(), "num_hidden_layers": 1, "architectures": ["Eagle3LlamaForCausalLM"],
             "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(EAGLE3_AUX_LAYERS)}}
    (path / "config.json").write_text(json.dumps(draft, indent=2))
    return path


def save_medusa(family: str, path: Path, seed: int = 3) -> Path:
    """A random Medusa draft for the family's tiny model, as vLLM's `Medusa` reads one: MEDUSA_HEADS heads, each
    a one-layer residual block over the target's last hidden state and an LM head (no attention, no KV)."""
    from safetensors.torch import save_file

    config = hf_config(family)
    hidden, vocab = config.hidden_size, config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for head in range(MEDUSA_HEADS):
        tensors[f"blocks.{head}.layers.0.weight"] = OTHER_STD * torch.randn(hidden, hidden, generator=gen)
        tensors[f"lm_heads.{head}.weight"] = STD["lm_head"] * torch.randn(vocab, hidden, generator=gen)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    medusa = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": hidden, "vocab_size": vocab,
              "num_heads": MEDUSA_HEADS, "num_hidden_layers": 1, "truncated_vocab_size": vocab}
    (path / "config.json").write_text(json.dumps(medusa, indent=2))
    return path


if __name__ == "__main__":
    print(save(sys.argv[1], Path(sys.argv[2])))
