"""Run inside vLLM's virtual environment (`python -P tests/vllm/shared_probe.py spec.json`): start vLLM with
the CacheFlow connector, run one prompt (the connector stores its chunks: vLLM's own KV), then report on
the connector's runtime: which one it chose, whether its tensors are vLLM's, its fingerprint, and the KV
it recomputes for the prompt's whole chunks next to the separate runtime's (torch.save'd for the test).

spec.json: {"model": dir, "prompt": [token ids], "block_size": 32, "chunk_size": 64, "connector": {...},
            "out": dir}
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def probe(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine (and connector) in this process
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from cacheflow_common.model.transformer import Transformer
    from cacheflow_common.restore.save import compute_prefix_kv, make_job
    from cacheflow_services.vllm_connector.drive import transfer_config

    out = Path(spec["out"])
    llm = LLM(model=spec["model"], dtype="float32", skip_tokenizer_init=True, seed=0, max_model_len=4096,
              enforce_eager=True, enable_prefix_caching=False, block_size=spec["block_size"],
              kv_transfer_config=transfer_config(spec["connector"]))
    prompt = spec["prompt"]
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0.0, max_tokens=1),
                 use_tqdm=False)
    connector = get_kv_transfer_group()
    connector.flush()
    engine = connector._engine
    vllm_model = llm.apply_model(lambda m: m)[0]  # the engine runs in this process: the module itself
    storages = {p.untyped_storage().data_ptr(): name for name, p in vllm_model.named_parameters()}
    runtime = engine.model
    owners = {name: storages.get(t.untyped_storage().data_ptr(), "") for name, t in runtime.weights.items()}

    n = len(prompt) // spec["chunk_size"] * spec["chunk_size"]
    separate = Transformer.from_dir(spec["model"], dtype=torch.float32)
    kvs = {}
    for label, model in (("shared", runtime), ("separate", separate)):
        job = make_job(model, prompt[:n], tenant=spec["connector"]["tenant"], chunk_size=spec["chunk_size"])
        kvs[label] = compute_prefix_kv(model, job).data.clone()  # [L, 2, Hkv, N, D]
    torch.save(kvs, out / "kv.pt")
    return {"runtime": engine.runtime, "runtime_class": type(runtime).__name__, "owners": owners,
            "fingerprint": runtime.fingerprint(), "separate_fingerprint": separate.fingerprint(),
            "engine_fingerprint": engine.fingerprint,
            "vllm_params": {name: [list(p.shape), p.numel() * p.element_size()]
                            for name, p in vllm_model.named_parameters()}}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = probe(spec)
    (Path(spec["out"]) / "probe.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
