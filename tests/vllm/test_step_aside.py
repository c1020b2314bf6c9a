"""A configuration the connector cannot restore correctly never stops vLLM: it steps aside (vLLM starts and
computes every prompt, giving the tokens it gives without the connector) and says why in its stats. What it
can serve beyond CacheFlow's own runtime: a family that runtime lacks, served by a Hub id, restored with
vLLM's own model; a `cache_salt` keying its own chunks; an fp8 KV cache; tensor parallelism (a meeting
point planned up front). Real vLLM (CPU build) processes against real storage pods."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cacheflow_bench.vllm_compat_cell import error_line
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.restore.profile import Crossover, Profile
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


FP8_CPU_UNSUPPORTED = "FP8 KV cache on CPU requires"  # vLLM's own error where the CPU lacks AVX-512 and AMX


def _connector(cluster: dict[str, Any], stats: Path) -> dict[str, Any]:
    return {"pods": [f"pod-0=127.0.0.1:{cluster['pod'].data_port}"], "tenant": "alpha",
            "pod_token_file": str(cluster["root"] / "tokens"), "chunk_size": CHUNK, "stats_file": str(stats)}


def _run(cluster: dict[str, Any], name: str, model: str, connector: dict[str, Any] | None,
         **spec: Any) -> list[list[int]]:
    spec = {"model": model, "prompts": cluster["prompts"], "max_tokens": 6, "block_size": BLOCK,
            "connector": connector, **spec}  # `spec` may name other prompts
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
    try:
        reference = _run(cluster, "fp8-reference", str(model_dir), None, kv_cache_dtype="fp8")
    except RuntimeError as exc:  # vLLM alone, without the connector: its CPU build needs AVX-512 or AMX for fp8
        if FP8_CPU_UNSUPPORTED not in str(exc):
            raise
        pytest.skip(f"vLLM's CPU build cannot run an fp8 KV cache on this CPU: {error_line(str(exc))}")
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
    connector stores a prompt, then restores it with vLLM's own model. The same prompt with a `cache_salt`
    finds none of those chunks; it is stored under its salt and restored from there."""
    hub, commit = cluster["root"] / "hub", "0123abcd" * 5
    repo = hub / "models--cacheflow-test--tiny-mistral"
    save_tiny_mistral(repo / "snapshots" / commit, sliding_window=None, seed=4)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    prompt, model = cluster["prompts"][0], "cacheflow-test/tiny-mistral"
    runs = {name: cluster["root"] / f"hub-{name}.jsonl" for name in ("save", "salted", "recompute")}

    def run(name: str, salts: list[str | None], **settings: Any) -> list[list[int]]:
        connector = {**_connector(cluster, runs[name]), **settings}
        return _run(cluster, f"hub-{name}", model, connector, prompts=[prompt] * len(salts), cache_salts=salts)

    [saved] = run("save", [None])
    salted_first, base = run("salted", ["tenant-b", None])  # the salted one finds nothing; the base one restores
    again = run("recompute", ["tenant-b", None], policy="compute-only")  # both from their own chunks
    assert salted_first == base == saved and again == [saved, saved]
    assert not any(_events(stats, "inactive") or _events(stats, "declined") for stats in runs.values())
    assert not _events(runs["save"], "restore")
    [loaded] = _events(runs["salted"], "restore")
    assert loaded["runtime"] == "vllm" and loaded["computed"] + loaded["loaded"] == 3  # front computed, back loaded
    assert len(_events(runs["salted"], "save")) == 1  # the salted prompt's chunks, under its salt
    recomputed = _events(runs["recompute"], "restore")
    assert [(e["computed"], e["loaded"]) for e in recomputed] == [(1, 0), (1, 0)]  # one forward of each prefix
    shutil.rmtree(hub)


def _tp_profile(path: Path) -> str:
    """Costs under which a 64-token chunk's recompute on a rank (4 layers) takes about as long as its load, so the
    planned split recomputes some chunks and loads the others: 1 of 3 for the 200-token prompt, 2 of 5 for the
    330-token one."""
    costs = CostModel(chunk_compute=LinearCost(fixed_s=2e-4, per_token_s=2e-6, per_token_ctx_s=1e-9),
                      layer_compute=LinearCost(fixed_s=2e-4, per_token_s=2e-6, per_token_ctx_s=1e-9),
                      load=LoadCost(bytes_per_s=6e7, latency_s=5e-5))
    Profile(model="tiny-qwen3-tp", model_name="tiny-qwen3-tp", dtype="float32", chunk_size=CHUNK, threads=1,
            costs=costs, crossovers=(Crossover(link_bytes_per_s=6e7, l_delta=0),)).save(path)
    return str(path)


def test_tensor_parallel_ranks_restore_their_own_heads(cluster: dict[str, Any]) -> None:
    """TP 2: each rank stores and restores the chunks of its own KV heads; the second pass restores every prompt
    on both ranks with the same planned split (the front recomputed with vLLM's model in lockstep, the back
    loaded in the background), with vLLM's own outputs. The prompts arrive together: their fronts share
    forwards. The third pass restores them again, planned with what each rank's loads measured: slower than the
    profile says (a read over loopback HTTP costs more than its 50 us), so the fronts move later, and the ranks,
    whose measurements differ, agree on each front."""
    model_dir = cluster["root"] / "tiny-qwen3-tp"
    save_tiny_qwen3(model_dir, seed=5)
    stats = cluster["root"] / "tp.jsonl"
    connector = {**_connector(cluster, stats), "profile": _tp_profile(cluster["root"] / "tp-profile.json")}
    spec = {"model": str(model_dir), "prompts": cluster["prompts"], "max_tokens": 6, "block_size": BLOCK,
            "connector": connector, "tensor_parallel_size": 2, "batches": [list(range(len(cluster["prompts"])))],
            "passes": [{"label": "cold"}, {"label": "warm"}, {"label": "again"}]}
    results = drive(spec, cluster["root"], "tp2")["results"]
    n = len(cluster["prompts"])
    cold, warm, again = results[:n], results[n : 2 * n], results[2 * n :]
    assert [r["tokens"] for r in warm] == [r["tokens"] for r in again] == [r["tokens"] for r in cold]
    restores = [e for e in _events(stats, "restore") if e["req"].startswith("warm")]
    calibrated = [e for e in _events(stats, "restore") if e["req"].startswith("again")]
    splits = {(e["tp_rank"], e["tokens"]): (e["computed"], e["loaded"]) for e in calibrated}
    assert len(splits) == 4 and all(splits[0, tokens] == splits[1, tokens] for tokens in (192, 320))  # agreed
    assert splits[0, 192][0] + splits[0, 320][0] > 1 + 2  # more recomputed than the profile's own plan
    assert all(e["written"] == e["tokens"] and not e["misses"] for e in calibrated)
    assert all(e["load_scale"] > 1 for e in calibrated)
    assert sorted((e["tp_rank"], e["tokens"], e["computed"], e["loaded"]) for e in restores) == [
        (0, 192, 1, 2), (0, 320, 2, 3), (1, 192, 1, 2), (1, 320, 2, 3)]
    assert all(not e["misses"] and e["written"] == e["tokens"] for e in restores)
    assert all(e["asynchronous"] for e in restores)  # the back loaded while vLLM stepped on (planned_loads.py)
    assert all(e["batch"] == len(cluster["prompts"]) for e in restores)  # started in one step, fronts together
    assert all(e["load_s"] > 0 and e["predicted_load_s"] > 0 for e in restores)  # each rank's loads timed, learnt


def test_tensor_parallel_fronts_step_beside_a_decoding_request(cluster: dict[str, Any]) -> None:
    """TP 2, fronts recomputed a chunk per vLLM step (`front_step_tokens`): the first prompt restores alone (nothing
    else runs, so its front runs in the step that starts it), the second arrives while the first decodes and its
    two-chunk front is spread over two of vLLM's steps, the first prompt decoding between them, on both ranks
    in lockstep; both with vLLM's own tokens."""
    model_dir = cluster["root"] / "tiny-qwen3-tp-steps"
    save_tiny_qwen3(model_dir, seed=7)
    stats = cluster["root"] / "tp-steps.jsonl"
    connector = {**_connector(cluster, stats), "profile": _tp_profile(cluster["root"] / "tp-profile.json"),
                 "calibrate": False, "front_step_tokens": CHUNK}  # the profile's own splits: 1 and 2 chunks
    spec = {"model": str(model_dir), "prompts": cluster["prompts"], "max_tokens": 16, "block_size": BLOCK,
            "connector": connector, "tensor_parallel_size": 2, "batches": [[0, 1]], "late": [1],
            "passes": [{"label": "cold"}, {"label": "warm"}]}
    results = drive(spec, cluster["root"], "tp2-steps")["results"]
    n = len(cluster["prompts"])
    assert [r["tokens"] for r in results[n:]] == [r["tokens"] for r in results[:n]]
    restores = [e for e in _events(stats, "restore") if e["req"].startswith("warm")]
    assert sorted((e["tp_rank"], e["tokens"], e["computed"], e["front_steps"]) for e in restores) == [
        (0, 192, 1, 1), (0, 320, 2, 2), (1, 192, 1, 1), (1, 320, 2, 2)]
    assert all(not e["misses"] and e["written"] == e["tokens"] and e["asynchronous"] for e in restores)


def test_tensor_parallel_sizes_share_chunks(cluster: dict[str, Any]) -> None:
    """Chunks stored by a TP 1 instance (all KV heads in one object) are restored by a TP 2 instance, each rank
    taking its heads out of them; chunks its ranks store (an object per rank's heads) are restored by a TP 1
    instance, which puts the two ranks' heads together. Three vLLM processes over one pod, each restore with
    loaded chunks and no miss, and the tokens of the instance that stored them."""
    model_dir = cluster["root"] / "tiny-qwen3-tp-share"
    save_tiny_qwen3(model_dir, seed=6)
    first, second = cluster["prompts"], [[(7 * t + 5) % 1024 for t in p] for p in cluster["prompts"]]
    stats = {name: cluster["root"] / f"share-{name}.jsonl" for name in ("tp1", "tp2", "tp1-again")}

    def run(name: str, tp: int, passes: list[tuple[str, list[list[int]]]]) -> dict[str, list[list[int]]]:
        connector = {**_connector(cluster, stats[name]), "profile": _tp_profile(cluster["root"] / "tp-profile.json"),
                     "calibrate": False}  # the profile as written: each restore loads some chunks
        tokens = {}
        for label, prompts in passes:  # one pass per prompt set: its saves flushed before the next starts
            spec = {"model": str(model_dir), "prompts": prompts, "max_tokens": 6, "block_size": BLOCK,
                    "connector": connector, "tensor_parallel_size": tp, "passes": [{"label": label}]}
            tokens[label] = [r["tokens"] for r in drive(spec, cluster["root"], f"share-{name}-{label}")["results"]]
        return tokens

    stored_whole = run("tp1", 1, [("first", first)])
    by_tp2 = run("tp2", 2, [("first", first), ("second", second)])
    stored_by_ranks = run("tp1-again", 1, [("second", second)])
    assert by_tp2["first"] == stored_whole["first"]
    assert stored_by_ranks["second"] == by_tp2["second"]
    restored_by_tp2 = [e for e in _events(stats["tp2"], "restore") if e["req"].startswith("first")]
    assert sorted((e["tp_rank"], e["tokens"]) for e in restored_by_tp2) == [(0, 192), (0, 320), (1, 192), (1, 320)]
    assert _events(stats["tp1"], "restore") == []  # nothing stored before its pass
    restored_by_tp1 = _events(stats["tp1-again"], "restore")
    assert sorted(e["tokens"] for e in restored_by_tp1) == [192, 320]
    assert all(e["loaded"] > 0 and not e["misses"] and e["written"] == e["tokens"]
               for e in restored_by_tp2 + restored_by_tp1)


def test_lora_restores_recompute_under_each_requests_adapter(cluster: dict[str, Any]) -> None:
    """LoRA on (2 slots), restores recomputed whole (compute-only); passes with the saves flushed and the
    prefix cache reset between them. Two vLLM processes over the same pod:
    1. Restores in vLLM's step. The base prompts, stored; the same prompts under adapter A, which find none
       of those chunks (its KV is not the base model's) and are stored under it; then "mix": the first
       prompt under A and the second, without an adapter, arriving while the first decodes. Each restores
       its own chunks, recomputed under its own adapter (or none): the second in a step that also decodes
       the first under A, whose mapping vLLM had set before the restore ran.
    2. Restores in the background (the request waits, its adapter not yet active). Adapters B then C take
       both slots; then A's prompts: recomputing the first under A would evict an adapter vLLM holds, so it
       loads only; the second arrives once the first decodes under A, and is recomputed under it; then the
       base prompts, recomputed.
    Every restore gives the tokens vLLM computed."""
    from cacheflow_bench.tiny_models import save, save_lora

    model_dir = save("qwen3", cluster["root"] / "lora-base")
    a, b, c = (str(save_lora("qwen3", model_dir, cluster["root"] / f"lora-{name}", seed=seed))
               for name, seed in (("a", 1), ("b", 2), ("c", 3)))
    stats = cluster["root"] / "lora.jsonl"
    connector = {**_connector(cluster, stats), "policy": "compute-only"}
    spec = {"model": str(model_dir), "prompts": cluster["prompts"], "max_tokens": 8, "block_size": BLOCK,
            "enable_lora": True, "batches": [[0, 1]], "late": [1],
            "max_loras": 2}  # a free last slot in "mix": vLLM's CPU ops give a row without an adapter the last slot's
    in_step = [{"label": "base"}, {"label": "lora", "lora": a}, {"label": "mix", "loras": [a, None]}]
    background = [{"label": "b", "lora": b}, {"label": "c", "lora": c}, {"label": "again", "lora": a},
                  {"label": "base2"}]
    results = drive({**spec, "connector": {**connector, "async_loads": False}, "passes": in_step},
                    cluster["root"], "lora-in-step")["results"]
    results += drive({**spec, "connector": connector, "passes": background}, cluster["root"], "lora")["results"]
    tokens: dict[str, list[list[int]]] = {}
    for r in results:
        tokens.setdefault(r["request_id"].split("-")[0], []).append(r["tokens"])  # "{pass}-{n}"
    assert tokens["lora"][0] != tokens["base"][0]  # the adapter changes the outputs: sharing KV would show
    assert tokens["mix"] == [tokens["lora"][0], tokens["base"][1]]
    assert tokens["again"] == tokens["lora"] and tokens["base2"] == tokens["base"]
    restores: dict[str, list[tuple[int, int, int, int]]] = {}
    for e in _events(stats, "restore"):  # "{pass}-{n}-{vLLM suffix}"
        restores.setdefault(e["req"].split("-")[0], []).append((e["tokens"], e["written"], e["computed"], e["loaded"]))
    assert set(restores) == {"mix", "again", "base2"}  # nothing restored across an adapter's boundary
    # recomputed whole, each in one unit (compute-only's unit is the engine's prefill size), nothing loaded
    assert sorted(restores["mix"]) == sorted(restores["base2"]) == [(192, 192, 1, 0), (320, 320, 1, 0)]
    # A's first prompt loads only (B and C hold the slots); its second arrives once the first decodes under A
    assert sorted(restores["again"]) == [(192, 192, 0, 3), (320, 320, 1, 0)]
    assert [e["reason"] for e in _events(stats, "load_only")] == ["all 2 of vLLM's LoRA slots hold other adapters"]
    assert not _events(stats, "load_error")
