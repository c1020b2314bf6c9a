"""The coordinator with the real small model (SmolLM2-135M-Instruct) and its tokenizer: text and chat
completions through 2 stage workers equal a single-process greedy run, prefilled and restored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from cacheflow_common.model.sources import load_model
from cacheflow_services.coordinator.tokenizer import TextCodec, tokenizer_dir
from cacheflow_services.local_cluster import ClusterSpec, start_cluster
from tests.factories import greedy_reference

pytestmark = pytest.mark.slow
CHUNK = 64
TEXT = ("The KV cache of a long conversation can be recomputed on the GPU or loaded back from storage. "
        "Doing both at once, from the two ends, finishes sooner than either alone. ") * 6


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    spec = ClusterSpec(model="smollm2", stages=2, pods=1, chunk_size=CHUNK, dtype="float32", policy="cake", port=0,
                       transport="tcp", threads_per_stage=1)
    local = start_cluster(spec, tmp_path_factory.mktemp("smollm2-cluster"))
    try:
        with httpx.Client(base_url=local.coordinator.url, headers={"Authorization": f"Bearer {local.token}"},
                          timeout=300) as c:
            yield c
    finally:
        local.stop()


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    directory = tokenizer_dir("smollm2")
    assert directory is not None
    return TextCodec(directory)


def test_text_completion_prefilled_then_restored_equals_a_single_process_run(client, codec):
    model = load_model("smollm2", dtype=torch.float32)
    prompt = codec.encode(TEXT)
    _, expected = greedy_reference(model, prompt, 8)
    expected = expected[: next((i for i, t in enumerate(expected) if t in codec.eos_ids), len(expected))]
    first = client.post("/v1/completions", json={"model": "smollm2", "prompt": TEXT, "max_tokens": 8}).json()
    assert first["choices"][0]["token_ids"] == expected
    assert first["choices"][0]["text"] == codec.decode(expected)
    second = {}
    for _ in range(50):  # the workers store the chunks in the background
        second = client.post("/v1/completions", json={"model": "smollm2", "prompt": TEXT, "max_tokens": 8}).json()
        if second["cacheflow"]["prompt_tokens_restored"]:
            break
    assert second["cacheflow"]["prompt_tokens_restored"] == (len(prompt) - 1) // CHUNK * CHUNK
    assert second["choices"][0]["token_ids"] == expected


def test_chat_streamed_equals_chat_whole(client):
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 12}
    whole = client.post("/v1/chat/completions", json=body).json()
    text = whole["choices"][0]["message"]["content"]
    assert text.strip() and whole["object"] == "chat.completion"
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:-1]]
    assert "".join(deltas) == text


def test_the_openai_sdk_streams_a_chat_completion_with_its_usage_last(client):
    sdk = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key=client.headers["Authorization"].split()[1],
                        max_retries=0, timeout=300.0)
    messages: list[Any] = [{"role": "user", "content": "Name three colours."}]
    whole = sdk.chat.completions.create(model="smollm2", messages=messages, max_tokens=6,
                                        extra_body={"ignore_eos": True})
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    stream = sdk.chat.completions.create(model="smollm2", messages=messages, max_tokens=6, stream=True,
                                         stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    *content, last = list(stream)
    assert content and all(c.usage is None and len(c.choices) == 1 for c in content), content
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    assert last.choices == [] and last.usage is not None, last
    assert last.usage.model_dump() == whole.usage.model_dump()


def test_stop_string_cuts_the_text(client):
    whole = client.post("/v1/completions", json={"model": "smollm2", "prompt": TEXT, "max_tokens": 8}).json()
    text = whole["choices"][0]["text"]
    stop = text.strip()[:3]
    body = {"model": "smollm2", "prompt": TEXT, "max_tokens": 8, "stop": stop}
    cut = client.post("/v1/completions", json=body).json()
    assert cut["choices"][0]["text"] == text[: text.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"
