"""The model runtime against transformers' own implementation, on tiny seeded random models (fp32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cacheflow_common.model.config import MoeConfig, RopeConfig
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span, Transformer
from tests.factories import tiny_model

transformers = pytest.importorskip("transformers")

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "llama-rope3": {"rope": RopeConfig(theta=500000.0, scaling="llama3", factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=16)},
    "llama-linear": {"rope": RopeConfig(theta=10000.0, scaling="linear", factor=4.0), "tie_word_embeddings": True},
    "qwen2": {},
    "qwen3": {},
    "qwen3-bias": {"attention_bias": True},
    "qwen3_moe": {},
    # Unnormalized top-k weights, MoE on every second layer only, top-1 of 3 experts.
    "qwen3_moe-sparse": {"num_layers": 4, "moe": MoeConfig(num_experts=3, experts_per_token=1, intermediate_size=40,
                                                           norm_topk_prob=False, sparse_step=2, mlp_only_layers=())},
}
TOL = 1e-4


def _ours(model: Transformer, ids: torch.Tensor) -> tuple[torch.Tensor, KVBuffer]:
    kv = KVBuffer.for_model(model.config, layers=range(model.config.num_layers), capacity=len(ids),
                            dtype=model.dtype)
    hidden = model.forward_layers(model.embed(ids), model.layers, [Span(kv, 0, len(ids))])
    return model.logits(hidden), kv


@pytest.mark.parametrize("variant", FAMILIES)
def test_logits_and_every_layers_kv_match_transformers(variant, tmp_path):
    family = variant.split("-")[0]
    model = tiny_model(family, seed=1, **FAMILIES[variant])
    model.save(tmp_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    ids = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = ref(ids[None], use_cache=True)
    logits, kv = _ours(model, ids)
    torch.testing.assert_close(logits, out.logits[0].float(), atol=TOL, rtol=TOL)
    cache = out.past_key_values
    for layer in range(model.config.num_layers):
        ref_k, ref_v = cache.layers[layer].keys[0], cache.layers[layer].values[0]  # [Hkv, T, D]
        torch.testing.assert_close(kv.layer(layer)[0], ref_k, atol=TOL, rtol=TOL)
        torch.testing.assert_close(kv.layer(layer)[1], ref_v, atol=TOL, rtol=TOL)


def test_our_loader_reads_what_transformers_saves(tmp_path):
    model = tiny_model("qwen3", seed=3)
    model.save(tmp_path / "ours")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    ref.save_pretrained(tmp_path / "theirs")
    loaded = Transformer.from_dir(tmp_path / "theirs")
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_sharded_checkpoint_loads_whole_and_in_part(tmp_path):
    model = tiny_model("llama", seed=4, num_layers=4)
    model.save(tmp_path / "ours")
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 2
    whole = Transformer.from_dir(tmp_path / "sharded")
    assert whole.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(whole.state_dict()[n], t) for n, t in model.state_dict().items())
    part = Transformer.from_dir(tmp_path / "sharded", layers=range(2, 4))
    assert {n for n in part.state_dict() if n.startswith("model.layers.")} == {
        n for n in model.state_dict() if n.startswith(("model.layers.2.", "model.layers.3."))}
    assert part.fingerprint() == whole.fingerprint() == model.fingerprint()


def test_bfloat16_stays_close_to_transformers(tmp_path):
    """bf16 runs through the same ops order as transformers; only rounding differs (SDPA vs eager)."""
    model = tiny_model("qwen3", seed=5)
    model.save(tmp_path)
    ours = Transformer.from_dir(tmp_path, dtype=torch.bfloat16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16,
                                                            attn_implementation="eager").eval()
    ids = torch.randint(0, model.config.vocab_size, (37,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = ref(ids[None], use_cache=True)
    logits, kv = _ours(ours, ids)
    assert kv.data.dtype == torch.bfloat16
    torch.testing.assert_close(logits, out.logits[0].float(), atol=2e-2, rtol=2e-2)
    for layer in range(model.config.num_layers):  # |K| reaches ~4, where one bf16 step is 1/64
        ref_k, ref_v = out.past_key_values.layers[layer].keys[0], out.past_key_values.layers[layer].values[0]
        torch.testing.assert_close(kv.layer(layer)[0], ref_k, atol=1 / 16, rtol=2e-2)
        torch.testing.assert_close(kv.layer(layer)[1], ref_v, atol=1 / 16, rtol=2e-2)
