"""A configuration the connector cannot restore correctly never stops vLLM: it steps aside (vLLM starts and
computes every prompt, giving the tokens it gives without the connector) and says why in its stats. A family
CacheFlow's own runtime does not implement, served by a Hub id, is restored with vLLM's own model. Real vLLM
(CPU build) processes against real storage pods."""

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


def save_tiny_mistral(model_dir: Path, *, sliding_window: int | None, seed: int = 1) -> None:
    """A tiny Mistral: Llama's weights (what vLLM's Mistral reads), a family CacheFlow's runtime lacks."""
    save_tiny_qwen3(model_dir, config=TINY_LLAMA, seed=seed)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=sliding_window)
    (model_dir / "config.json").write_text(json.dumps(config))


def test_a_sliding_window_cache_steps_aside(cluster: dict[str, Any]) -> None:
    """Every layer windowed: vLLM drops blocks outside the window, which chunks cannot be restored into."""
    model_dir = cluster["root"] / "tiny-mistral-window"
    save_tiny_mistral(model_dir, sliding_window=64)
    stats = cluster["root"] / "window.jsonl"
    _run(cluster, "window-connector", str(model_dir), _connector(cluster, stats))
    inactive = _events(stats, "inactive")
    assert {e["role"] for e in inactive} == {"scheduler", "worker"}
    assert all("SlidingWindowSpec" in e["reason"] for e in inactive), inactive
    assert not _events(stats, "restore") and not _events(stats, "save")


def test_an_fp8_kv_cache_is_restored_as_its_bytes_and_only_into_fp8(cluster: dict[str, Any]) -> None:
    """`--kv-cache-dtype fp8`: chunks hold the cache's fp8 bytes; vLLM's model recomputes the front in fp8;
    the outputs are vLLM's own. A model-dtype cache over the same pods finds none of those chunks."""
    model_dir = cluster["root"] / "tiny-qwen3"
    save_tiny_qwen3(model_dir)
    stats = cluster["root"] / "fp8.jsonl"
    connector = _connector(cluster, stats)
    reference = _run(cluster, "fp8-reference", str(model_dir), None, kv_cache_dtype="fp8")
    saved = _run(cluster, "fp8-save", str(model_dir), connector, kv_cache_dtype="fp8")
    restored = _run(cluster, "fp8-restore", str(model_dir), connector, kv_cache_dtype="fp8")
    assert saved == reference and restored == reference
    assert not _events(stats, "inactive")
    restores = _events(stats, "restore")
    assert [e["tokens"] for e in restores] == [192, 320]
    assert all(e["runtime"] == "vllm" and e["computed"] + e["loaded"] == e["tokens"] // CHUNK for e in restores)
    full = cluster["root"] / "full.jsonl"
    _run(cluster, "full-dtype", str(model_dir), _connector(cluster, full))
    assert not _events(full, "restore") and _events(full, "save")


def test_a_hub_id_is_read_from_the_local_cache(cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm serve org/name` with a Mistral (no runtime of CacheFlow's) in the Hub cache (offline): the
    connector stores, then restores the first prompt with vLLM's own model; the second asks for a
    `cache_salt`, and is neither stored nor restored."""
    hub, commit = cluster["root"] / "hub", "0123abcd" * 5
    repo = hub / "models--cacheflow-test--tiny-mistral"
    save_tiny_mistral(repo / "snapshots" / commit, sliding_window=None, seed=4)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    stats = cluster["root"] / "hub.jsonl"
    connector = _connector(cluster, stats)
    salts = [None, "tenant-b"]
    saved = _run(cluster, "hub-save", "cacheflow-test/tiny-mistral", connector, cache_salts=salts)
    restored = _run(cluster, "hub-restore", "cacheflow-test/tiny-mistral", connector, cache_salts=salts)
    recomputed = _run(cluster, "hub-recompute", "cacheflow-test/tiny-mistral", {**connector, "policy": "compute-only"},
                      cache_salts=salts)
    assert restored == saved and recomputed == saved
    assert not _events(stats, "inactive")
    loaded, computed = _events(stats, "restore")  # the 3 chunks of the first prompt, twice
    assert loaded["runtime"] == computed["runtime"] == "vllm"
    assert loaded["computed"] + loaded["loaded"] == 3  # the front recomputed, the back loaded (as they met)
    assert (computed["computed"], computed["loaded"]) == (1, 0)  # compute-only: one forward of the whole prefix
    assert len(_events(stats, "save")) >= 1 and all(e["tokens_end"] <= 200 for e in _events(stats, "save"))
    declined = _events(stats, "declined")
    assert len(declined) == 3 and all("cache_salt" in e["reason"] for e in declined), declined
    shutil.rmtree(hub)
