"""A configuration the connector cannot restore correctly never stops vLLM: it steps aside (vLLM starts and
computes every prompt, giving the tokens it gives without the connector) and says why in its stats; a Hub
id as the model is resolved in the local cache. Real vLLM (CPU build) processes against real storage pods."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cacheflow_services.storage.launch import launch_pod, write_tokens
from tests.vllm.helpers import VLLM_PYTHON, drive, read_stats, save_tiny_qwen3

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")

CHUNK, BLOCK = 64, 32
TINY_LLAMA = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "rms_norm_eps": 1e-6, "rope_theta": 1e4, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("step-aside")
    tokens = write_tokens(root / "tokens", ["alpha"])
    pod = launch_pod(root / "pod0", tenants=("alpha",), tokens=tokens)
    rng = random.Random(3)
    yield {"root": root, "pod": pod, "prompts": [[rng.randrange(1024) for _ in range(n)] for n in (200, 330)]}
    pod.stop()


def _connector(cluster: dict[str, Any], stats: Path) -> dict[str, Any]:
    return {"pods": [f"pod-0=127.0.0.1:{cluster['pod'].data_port}"], "tenant": "alpha",
            "pod_token_file": str(cluster["root"] / "tokens"), "chunk_size": CHUNK, "stats_file": str(stats)}


def _run(cluster: dict[str, Any], name: str, model: str, connector: dict[str, Any] | None,
         **spec: Any) -> list[list[int]]:
    spec = {"model": model, "prompts": cluster["prompts"], "max_tokens": 6, "block_size": BLOCK,
            "connector": connector, **spec}
    return [r["tokens"] for r in drive(spec, cluster["root"], name)["results"]]


def _events(stats: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_stats(stats) if e["event"] == kind]


def test_a_model_family_it_cannot_recompute_steps_aside(cluster: dict[str, Any]) -> None:
    model_dir = cluster["root"] / "tiny-mistral"
    save_tiny_qwen3(model_dir, config=TINY_LLAMA)  # Llama weights: what vLLM's Mistral reads
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    (model_dir / "config.json").write_text(json.dumps(config))
    stats = cluster["root"] / "mistral.jsonl"
    reference = _run(cluster, "mistral-reference", str(model_dir), None)
    with_connector = _run(cluster, "mistral-connector", str(model_dir), _connector(cluster, stats))
    assert with_connector == reference
    inactive = _events(stats, "inactive")
    assert {e["role"] for e in inactive} == {"scheduler", "worker"}
    assert all("unsupported model_type 'mistral'" in e["reason"] for e in inactive), inactive
    assert not _events(stats, "restore") and not _events(stats, "save")


def test_an_fp8_kv_cache_steps_aside(cluster: dict[str, Any]) -> None:
    model_dir = cluster["root"] / "tiny-qwen3"
    save_tiny_qwen3(model_dir)
    stats = cluster["root"] / "fp8.jsonl"
    reference = _run(cluster, "fp8-reference", str(model_dir), None, kv_cache_dtype="fp8")
    with_connector = _run(cluster, "fp8-connector", str(model_dir), _connector(cluster, stats), kv_cache_dtype="fp8")
    assert with_connector == reference
    inactive = _events(stats, "inactive")
    assert inactive and all("KV cache dtype fp8" in e["reason"] for e in inactive), inactive


def test_a_hub_id_is_read_from_the_local_cache(cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm serve org/name` with the model in the Hub cache (offline): the connector stores, then restores
    the first prompt; the second asks for a `cache_salt`, and is neither stored nor restored."""
    hub = cluster["root"] / "hub"
    snapshot = hub / "models--cacheflow-test--tiny-qwen3" / "snapshots" / "0123abcd"
    save_tiny_qwen3(snapshot, seed=4)
    (hub / "models--cacheflow-test--tiny-qwen3" / "refs").mkdir()
    (hub / "models--cacheflow-test--tiny-qwen3" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    stats = cluster["root"] / "hub.jsonl"
    connector = _connector(cluster, stats)
    salts = [None, "tenant-b"]
    saved = _run(cluster, "hub-save", "cacheflow-test/tiny-qwen3", connector, cache_salts=salts)
    restored = _run(cluster, "hub-restore", "cacheflow-test/tiny-qwen3", connector, cache_salts=salts)
    assert restored == saved
    assert not _events(stats, "inactive")
    [restore] = _events(stats, "restore")
    assert restore["computed"] + restore["loaded"] > 0
    assert len(_events(stats, "save")) >= 1 and all(e["tokens_end"] <= 200 for e in _events(stats, "save"))
    declined = _events(stats, "declined")
    assert len(declined) == 2 and all("cache_salt" in e["reason"] for e in declined), declined
    shutil.rmtree(hub)
