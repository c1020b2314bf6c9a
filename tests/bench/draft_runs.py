"""One vLLM (CPU) process with a speculative draft and the CacheFlow connector over a storage pod, as the draft
restore tests run it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cacheflow_bench.vllm_compat_cell import BLOCK, CHUNK, PREFIXES, SPEC_TOKENS, drive, fixed_plan, prompts
from cacheflow_services.storage.launch import launch_pod, write_tokens

TENANT = "eagle"


def run(root: Path, name: str, models: tuple[Path, Path], *, draft: bool, tp: int, method: str = "eagle",
        adapter: Path | None = None) -> dict[str, Any]:
    """One fresh vLLM process of `models[0]` over the pod in `root`: its prompts once; `draft`: with the draft
    `models[1]` (its `method`); `tp` tensor-parallel ranks; `adapter`: LoRA on, every prompt under it; a process
    named "...rerun" stores and loads no draft KV (`draft_kv: false`: restores rerun the draft). Its tokens, vLLM's
    draft counters and the connector's events."""
    target, draft_model = models
    connector = {"pods": [f"pod-0=127.0.0.1:{(root / 'port').read_text()}"], "tenant": TENANT,
                 "pod_token_file": str(root / "tokens"), "chunk_size": CHUNK, "stats_file": str(root / f"{name}.jsonl"),
                 "draft_kv": not name.endswith("rerun"), **fixed_plan(root / "profile.json")}
    spec = {"model": str(target), "dtype": "float32", "prompts": prompts(), "max_tokens": 32, "ignore_eos": True,
            "speculative_config": {"method": method, "model": str(draft_model), "num_speculative_tokens": SPEC_TOKENS}
            if draft else None,
            "block_size": BLOCK, "max_model_len": 1024, "tensor_parallel_size": tp, "connector": connector,
            "enable_lora": adapter is not None, "passes": [{"label": name, "lora": str(adapter) if adapter else None}]}
    result, log = drive(spec, root, name)
    assert result is not None, log[-3000:]
    events = [json.loads(line) for line in (root / f"{name}.jsonl").read_text().splitlines()]
    return {"tokens": [r["tokens"] for r in result["results"]], "drafts": result["spec_decode"][-1] if draft else {},
            "events": events}


def run_pods(root: Path, passes: Mapping[str, Sequence[tuple[str, bool, int]]], models: tuple[Path, Path],
             method: str = "eagle", adapter: Path | None = None) -> dict[str, Any]:
    """Per pod (its name in `passes`, a fresh pod under root/<name>), its passes in order, each (name, with the
    draft, TP) a fresh process (`run`; `adapter`: under it, but for passes named "base..."): what each gave,
    by name, and each pod's folder as "<pod>-dir"."""
    out: dict[str, Any] = {}
    for pod_name, pod_passes in passes.items():
        work = root / pod_name
        work.mkdir()
        pod = launch_pod(work / "pod", tenants=(TENANT,), tokens=write_tokens(work / "tokens", [TENANT]))
        (work / "port").write_text(str(pod.data_port))
        try:
            for name, draft, tp in pod_passes:
                under = None if name.startswith("base") else adapter
                out[name] = run(work, name, models, draft=draft, tp=tp, method=method, adapter=under)
        finally:
            pod.stop()
        out[f"{pod_name}-dir"] = work / "pod"
    return out


def check_restored_as_cold(cold: dict[str, Any], warm: dict[str, Any], tp: int, *, rows: bool = True,
                           rerun: bool = False) -> None:
    """`warm` restored every prefix on each of its `tp` ranks in the background (loading and recomputing chunks),
    loaded the draft's KV stored with every chunk (`rerun`: reran the draft over all of it instead), and gave
    `cold`'s greedy tokens and draft counters (drafted, draft tokens, accepted: all equal). `rows`: the draft
    reads rows stored with the chunks (EAGLE, MTP; a draft model none), so its reruns read some from storage
    (those of the chunks loaded); a draft whose KV was loaded reads none."""
    restores = [e for e in warm["events"] if e["event"] == "restore"]
    assert len(restores) == len(PREFIXES) * tp and all(e["loaded"] > 0 for e in restores), restores
    assert all(e["asynchronous"] for e in restores)  # vLLM stepped the batch meanwhile
    assert sum(e["computed"] for e in restores) > 0  # the profile's plan recomputes the front of some
    assert sum(e["computed"] + e["loaded"] for e in restores) == sum(n // CHUNK for n in PREFIXES) * tp
    draft_passes = [e for e in warm["events"] if e["event"] == "draft"]  # one per rank
    expected = [(n, 0, 0) if rerun else (0, n, 0) for n in PREFIXES] * tp  # (tokens rerun, loaded, short)
    assert sorted((e["tokens"], e["loaded"], e["short"]) for e in draft_passes) == sorted(expected), draft_passes
    assert (sum(e["bytes_read"] for e in draft_passes) > 0) == (rows and rerun)
    assert (sum(e["loaded_bytes"] for e in draft_passes) > 0) == (not rerun)
    assert warm["tokens"] == cold["tokens"]
    assert warm["drafts"] == cold["drafts"]
