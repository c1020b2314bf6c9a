"""When the connector's worker side picks CacheFlow's runtime (`runtime: cacheflow`; no vLLM here: the
resolver of vLLM's model is a stub).

vLLM's model is asked for at start-up, again when the KV caches are registered, and at the first load;
only when it still cannot be reached then does the connector load its own copy of the weights, and it
says why once. The engine's fingerprint (its chunk keys) is the checkpoint's, whichever runtime runs.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from cacheflow_services.vllm_connector.config import ConnectorConfig
from cacheflow_services.vllm_connector.worker import WorkerEngine
from tests.vllm.helpers import save_tiny_qwen3

BLOCK = 32


def engine_for(tmp_path: Path, resolver: Any, **settings: Any) -> WorkerEngine:
    (tmp_path / "tokens").write_text("alpha secret\n")
    cfg = ConnectorConfig(pods=("pod-0=127.0.0.1:9",), tenant="alpha", pod_token_file=str(tmp_path / "tokens"),
                          model=str(tmp_path / "model"), stats_file=str(tmp_path / "stats.jsonl"), runtime="cacheflow",
                          **settings)
    return WorkerEngine(cfg, dtype=torch.float32, block_size=BLOCK, device="cpu", layout="cpu-vec",
                        vllm_model=resolver)


def caches(layers: int, kv_heads: int, head_dim: int) -> dict[str, torch.Tensor]:
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(4, kv_heads, BLOCK, 2 * head_dim) for i in range(layers)}


def runtime_events(tmp_path: Path) -> list[dict[str, Any]]:
    lines = (tmp_path / "stats.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == "runtime"]


def test_unreachable_model_falls_back_only_at_the_first_load_and_says_so_once(tmp_path, caplog):
    model = save_tiny_qwen3(tmp_path / "model")
    asked: list[int] = []
    engine = engine_for(tmp_path, lambda: asked.append(1))  # never finds vLLM's model
    try:
        assert engine.runtime == "" and len(asked) == 1  # start-up: asked, nothing loaded yet
        c = model.config
        engine.register(caches(c.num_layers, c.num_kv_heads, c.head_dim))
        assert engine.runtime == "" and len(asked) == 2
        assert engine.fingerprint == model.fingerprint()
        with caplog.at_level(logging.WARNING):
            runtime = engine.model  # the first load
            assert engine.model is runtime
        assert len(asked) == 3 and engine.runtime == "separate"
        assert runtime.fingerprint() == model.fingerprint()
        [event] = runtime_events(tmp_path)
        assert event["runtime"] == "separate" and "could not be reached" in event["reason"]
        warnings = [r for r in caplog.records if "own copy of the weights" in r.getMessage()]
        assert len(warnings) == 1 and "could not be reached" in warnings[0].getMessage()
    finally:
        engine.close()


def test_share_weights_off_loads_the_copy_at_start_up_without_asking(tmp_path):
    save_tiny_qwen3(tmp_path / "model")
    asked: list[int] = []
    engine = engine_for(tmp_path, lambda: asked.append(1), share_weights=False)
    try:
        assert engine.runtime == "separate" and not asked
        [event] = runtime_events(tmp_path)
        assert event["reason"] == "share_weights is off" and event["own_bytes"] > 0
    finally:
        engine.close()
