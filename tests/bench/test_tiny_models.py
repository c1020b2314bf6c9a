"""The compatibility matrix's tiny checkpoints can show a wrong KV: each family's greedy tokens (the ones a
cell compares) depend on the prompt's prefix, not only on its last tokens. Run with transformers' own model
classes, the checkpoints' reference implementation; a family whose tokens ignored the prefix would pass its
cell with any KV restored."""

import random
from typing import Any

import pytest
import torch

from cacheflow_bench import tiny_models
from cacheflow_bench.vllm_compat_cell import CHUNK, MAX_TOKENS, prompts

SWAPPED_CHUNKS = (0, 1, 2)  # each prompt's first three chunks, one at a time
MIN_CHANGED = 3  # of the 3 prompts x 3 chunks: swaps that change the greedy tokens


def greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def swapped(prompt: list[int], chunk: int, rng: random.Random) -> list[int]:
    """`prompt` with chunk `chunk` of its prefix replaced by other tokens (another prompt's KV restored there)."""
    start = chunk * CHUNK
    return [*prompt[:start], *(rng.randrange(tiny_models.VOCAB) for _ in range(CHUNK)), *prompt[start + CHUNK:]]


@pytest.mark.parametrize("family", list(tiny_models.FAMILIES))
def test_greedy_tokens_depend_on_the_prefix(family):
    model = tiny_models.build(family).eval()
    rng = random.Random(1)
    changed = 0
    for prompt in prompts():
        reference = greedy(model, prompt)
        changed += sum(greedy(model, swapped(prompt, c, rng)) != reference for c in SWAPPED_CHUNKS)
    assert changed >= MIN_CHANGED, f"{family}: only {changed} of 9 swapped chunks change the greedy tokens"
