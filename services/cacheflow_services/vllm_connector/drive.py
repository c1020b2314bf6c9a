"""Run prompts through vLLM (offline, in this process), with or without the CacheFlow connector.

    python -m cacheflow_services.vllm_connector.drive run.json

run.json: {"model": dir, "prompts": [[token ids], ...], "max_tokens": 8, "out": path,
           "connector": {extra config} or null, "max_model_len": 4096, "dtype": "float32", "prefix_caching": false,
           "block_size": 128, "max_num_batched_tokens": vLLM's default}

Writes to `out`: per prompt the greedy tokens, their logprobs and the request's wall time (with
max_tokens=1 that is its TTFT), and the engine's start-up time. Prompts run one at a time, in order.
Run it with vLLM's Python (its own virtual environment) and `-P` (the repository root must not be on
sys.path: operator/ there shadows the standard library); it waits for the connector's saves before exiting.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

CONNECTOR_MODULE = "cacheflow_services.vllm_connector.connector"


def transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "CacheFlowConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: starts faster
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    extra = spec.get("connector")
    # the scheduler's token budget per step (vLLM's default on CPU: 4,096, so a longer prompt is prefilled in chunks)
    budget = {"max_num_batched_tokens": spec["max_num_batched_tokens"]} if "max_num_batched_tokens" in spec else {}
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "float32"), skip_tokenizer_init=True, seed=0,
              max_model_len=spec.get("max_model_len", 4096), enforce_eager=True,
              enable_prefix_caching=spec.get("prefix_caching", False), block_size=spec.get("block_size", 128),
              **budget,
              kv_transfer_config=transfer_config(extra) if extra is not None else None)
    startup_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), logprobs=1)
    results = []
    for ids in spec["prompts"]:
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0].outputs[0]
        wall = time.perf_counter() - t0
        logprobs = [lp[t].logprob for lp, t in zip(out.logprobs or [], out.token_ids, strict=True)]
        results.append({"tokens": list(out.token_ids), "logprobs": logprobs, "wall_s": wall})
    if extra is not None:
        _flush_saves()
    return {"startup_s": startup_s, "results": results}


def _flush_saves() -> None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if has_kv_transfer_group():
        get_kv_transfer_group().flush()


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    result = run(spec)
    with open(spec["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
