"""One vLLM (CPU) process with a speculative draft and the CacheFlow connector over a storage pod, as the draft
restore tests run it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cacheflow_bench.vllm_compat_cell import BLOCK, CHUNK, SPEC_TOKENS, drive, prompts, write_profile

TENANT = "eagle"


def run(root: Path, name: str, models: tuple[Path, Path], *, draft: bool, tp: int, method: str = "eagle"
        ) -> dict[str, Any]:
    """One fresh vLLM process of `models[0]` over the pod in `root`: its prompts once; `draft`: with the draft
    `models[1]` (its `method`); `tp` tensor-parallel ranks. Its tokens, vLLM's draft counters and the
    connector's events."""
    target, draft_model = models
    connector = {"pods": [f"pod-0=127.0.0.1:{(root / 'port').read_text()}"], "tenant": TENANT,
                 "pod_token_file": str(root / "tokens"), "chunk_size": CHUNK, "stats_file": str(root / f"{name}.jsonl"),
                 "profile": str(write_profile(root / "profile.json"))}
    spec = {"model": str(target), "dtype": "float32", "prompts": prompts(), "max_tokens": 32, "ignore_eos": True,
            "speculative_config": {"method": method, "model": str(draft_model), "num_speculative_tokens": SPEC_TOKENS}
            if draft else None,
            "block_size": BLOCK, "max_model_len": 1024, "tensor_parallel_size": tp, "connector": connector,
            "passes": [{"label": name}]}
    result, log = drive(spec, root, name)
    assert result is not None, log[-3000:]
    events = [json.loads(line) for line in (root / f"{name}.jsonl").read_text().splitlines()]
    return {"tokens": [r["tokens"] for r in result["results"]], "drafts": result["spec_decode"][-1] if draft else {},
            "events": events}
