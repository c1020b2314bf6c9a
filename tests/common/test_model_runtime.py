"""The runtime's own contracts: chunked == one-pass, stage splits, packed batches, partial loads, fingerprints."""

from __future__ import annotations

import json

import pytest
import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span, Transformer
from tests.factories import tiny_model

N = 37


def _ids(seed: int = 0, n: int = N) -> torch.Tensor:
    return torch.randint(0, 384, (n,), generator=torch.Generator().manual_seed(seed))


def _kv(model: Transformer, layers: range | None = None, capacity: int = N) -> KVBuffer:
    return KVBuffer.for_model(model.config, layers=layers or model.layers, capacity=capacity, dtype=model.dtype)


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny_model("qwen3", seed=0, num_layers=4)


def test_chunked_equals_one_pass(model):
    ids = _ids()
    one_kv = _kv(model)
    one = model.forward_layers(model.embed(ids), model.layers, [Span(one_kv, 0, N)])
    kv = _kv(model)
    outs = [model.forward_layers(model.embed(ids[a:b]), model.layers, [Span(kv, a, b - a)])
            for a, b in [(0, 10), (10, 23), (23, N)]]
    torch.testing.assert_close(torch.cat(outs), one, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kv.data, one_kv.data, atol=1e-5, rtol=1e-5)


def test_stage_split_equals_all_layers(model):
    ids = _ids(1)
    full_kv = _kv(model)
    full = model.forward_layers(model.embed(ids), model.layers, [Span(full_kv, 0, N)])
    kv0, kv1 = _kv(model, range(0, 1)), _kv(model, range(1, 4))
    boundary = model.forward_layers(model.embed(ids), range(0, 1), [Span(kv0, 0, N)])
    out = model.forward_layers(boundary, range(1, 4), [Span(kv1, 0, N)])
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([kv0.data, kv1.data]), full_kv.data, atol=1e-5, rtol=1e-5)


def test_packed_batch_equals_separate_requests(model):
    a_ids, b_ids = _ids(2, 20), _ids(3, 30)
    # Request A: positions [8, 20) on top of its first 8 tokens; request B: [0, 30).
    sep_a, sep_b = _kv(model), _kv(model)
    model.forward_layers(model.embed(a_ids[:8]), model.layers, [Span(sep_a, 0, 8)])
    out_a = model.forward_layers(model.embed(a_ids[8:]), model.layers, [Span(sep_a, 8, 12)])
    out_b = model.forward_layers(model.embed(b_ids), model.layers, [Span(sep_b, 0, 30)])
    pk_a, pk_b = _kv(model), _kv(model)
    model.forward_layers(model.embed(a_ids[:8]), model.layers, [Span(pk_a, 0, 8)])
    packed = torch.cat([model.embed(a_ids[8:]), model.embed(b_ids)])  # [42, hidden]
    out = model.forward_layers(packed, model.layers, [Span(pk_a, 8, 12), Span(pk_b, 0, 30)])
    torch.testing.assert_close(out, torch.cat([out_a, out_b]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pk_a.data, sep_a.data, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pk_b.data, sep_b.data, atol=1e-5, rtol=1e-5)


def test_partial_load_holds_only_its_layers_and_matches(model, tmp_path):
    model.save(tmp_path)
    part = Transformer.from_dir(tmp_path, layers=range(1, 3))
    assert not any(k.startswith(("model.layers.0.", "model.layers.3.")) for k in part.state_dict())
    ids = _ids(4)
    h_in = model.forward_layers(model.embed(ids), range(0, 1), [Span(_kv(model, range(0, 1)), 0, N)])
    kv_full, kv_part = _kv(model, range(1, 3)), _kv(part, range(1, 3))
    ref = model.forward_layers(h_in, range(1, 3), [Span(kv_full, 0, N)])
    got = part.forward_layers(h_in, range(1, 3), [Span(kv_part, 0, N)])
    assert torch.equal(got, ref) and torch.equal(kv_part.data, kv_full.data)
    with pytest.raises(ConfigError):
        part.forward_layers(h_in, range(0, 1), [Span(_kv(model, range(0, 1)), 0, N)])
    assert part.fingerprint() == Transformer.from_dir(tmp_path).fingerprint()


def test_fingerprints(tmp_path):
    a = tiny_model("qwen3", seed=0)
    assert a.fingerprint() == tiny_model("qwen3", seed=0).fingerprint()
    assert a.fingerprint() != tiny_model("qwen3", seed=1).fingerprint()
    assert a.fingerprint() != tiny_model("qwen3", seed=0, num_layers=2).fingerprint()
    assert a.fingerprint() != tiny_model("qwen3", seed=0, dtype=torch.bfloat16).fingerprint()
    a.save(tmp_path / "a")
    fp = Transformer.from_dir(tmp_path / "a").fingerprint()
    assert fp == a.fingerprint()  # equal weights, equal fingerprint: a save/load round trip keeps it
    assert len(fp) == 32 and int(fp, 16) >= 0
    assert fp == Transformer.from_dir(tmp_path / "a", layers=range(2, 3)).fingerprint()
    assert fp != Transformer.from_dir(tmp_path / "a", dtype=torch.bfloat16).fingerprint()
    a.weights["model.layers.1.mlp.up_proj.weight"][3, 5] += 1.0
    a.save(tmp_path / "b")
    assert Transformer.from_dir(tmp_path / "b").fingerprint() != fp


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "gpt2"}, "unsupported model_type"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"vocab_size": None}, "vocab_size"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope scaling"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]}, "layer_types"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}, "sliding_attention": {"rope_theta": 1e4}}},
     "nested"),
    ({"hidden_size": "96"}, "'hidden_size' must be an integer"),
    ({"num_hidden_layers": 2.5}, "'num_hidden_layers' must be an integer"),
    ({"num_attention_heads": 0}, "num_attention_heads must be positive"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"dtype": "float64"}, "unsupported dtype"),
])
def test_bad_configs_are_rejected(change, message):
    d = tiny_model("qwen2").config.to_hf_dict()
    d.update(change)
    if change.get("vocab_size", 0) is None:
        del d["vocab_size"]
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


@pytest.mark.parametrize(("change", "message"), [
    ({"num_experts": None}, "num_experts"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers"),
])
def test_bad_moe_configs_are_rejected(change, message):
    d = tiny_model("qwen3_moe").config.to_hf_dict() | change
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(d)


def test_config_round_trips(tmp_path):
    for family in ("llama", "qwen2", "qwen3", "qwen3_moe"):
        cfg = tiny_model(family).config
        (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
        assert ModelConfig.from_dir(tmp_path) == cfg


def test_old_and_new_config_styles_agree():
    new = tiny_model("qwen3_moe").config
    d = new.to_hf_dict()
    old = {k: v for k, v in d.items() if k not in ("rope_parameters", "num_experts", "head_dim", "dtype")}
    old |= {"rope_theta": 10000.0, "num_local_experts": 4, "torch_dtype": "float32"}
    assert ModelConfig.from_hf_dict(old) == new  # head_dim defaults to hidden / heads = 96 / 4
    assert ModelConfig.from_hf_dict({**d, "head_dim": 16}).head_dim == 16
    llama = tiny_model("llama").config.to_hf_dict()
    del llama["rope_parameters"]
    llama |= {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}
    rope = ModelConfig.from_hf_dict(llama).rope
    assert (rope.scaling, rope.theta, rope.factor, rope.original_max_position_embeddings) == ("llama3", 5e5, 8.0, 16)


def test_explicit_rows_and_empty_layers(model):
    a_ids, b_ids = _ids(5, 9), _ids(6, 7)
    kv_a, kv_b, kv_a2, kv_b2 = _kv(model), _kv(model), _kv(model), _kv(model)
    packed = torch.cat([model.embed(a_ids), model.embed(b_ids)])  # [16, hidden]
    ref = model.forward_layers(packed, model.layers, [Span(kv_a, 0, 9), Span(kv_b, 0, 7)])
    # The same rows, spans listed in the other order with explicit rows.
    got = model.forward_layers(packed, model.layers, [Span(kv_b2, 0, 7, row=9), Span(kv_a2, 0, 9, row=0)])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(model.forward_layers(packed, range(2, 2), [Span(kv_a, 0, 16)]), packed)
    with pytest.raises(ValueError, match="tile"):
        model.forward_layers(packed, model.layers, [Span(kv_a, 0, 9, row=1), Span(kv_b, 0, 7, row=9)])
    with pytest.raises(ValueError, match="capacity"):
        model.forward_layers(model.embed(a_ids), model.layers, [Span(kv_a, N - 4, 9)])


def test_kv_size_follows_the_runtime_dtype(model):
    kv = _kv(model)
    per_token_layer = kv.data[0, :, :, 0].numel() * kv.data.element_size()
    assert model.kv_bytes_per_token_per_layer == per_token_layer
    assert tiny_model("qwen3", dtype=torch.bfloat16).kv_bytes_per_token_per_layer == per_token_layer // 2
