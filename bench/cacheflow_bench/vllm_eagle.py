"""What an EAGLE draft adds to a restore, on vLLM (CPU): the connector's restores and vLLM's own prefills, with the
draft and without it.

    cacheflow bench vllm-eagle [--quick] [--lengths 1024,2048,4096] [--repeats 3] [--out DIR]

The vLLM bench's model (random Qwen3, 8 layers, hidden 512, fp32) and a random one-layer EAGLE draft for it
(`tiny_models.save_eagle` over its config). One process stores each prompt's chunks with the draft on (KV and
the target's output rows). Then one process per setting — draft on, draft off — alternates, per length, a
stored prompt (the connector restores it: CacheFlow's policy with a profile, the pod on loopback; with the
draft on, the restore also reruns the draft: `draft.py`) and a fresh one of the same length (vLLM prefills it,
with the draft on also running its drafter over the prompt), after a warm-up. Each prompt asks for one token:
its wall time is its time to first token (with the draft on, the step that samples it also drafts). Medians
of `repeats`; the connector's stats give each restore's time and its draft's rerun.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheflow_bench import tiny_models
from cacheflow_bench.common import SCRATCH_DIR, add_out_option, markdown_table, median, provenance, publish
from cacheflow_bench.vllm import MODEL, SUFFIX, VOCAB, Bench, require_vllm

SETTINGS = ("eagle", "plain")  # the draft on, off
DRAFT_TOKENS = 3


def save_draft(bench: Bench) -> Path:
    """A random one-layer EAGLE draft of the bench's model (a Llama layer of its width: vLLM's EAGLE head)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    settings: dict[str, Any] = {k: MODEL[k] for k in keys}
    config = LlamaConfig(**settings, num_hidden_layers=1, tie_word_embeddings=False)
    torch.manual_seed(2)
    return tiny_models.eagle_from(LlamaForCausalLM(config), bench.root / "eagle")


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    bench = Bench(root, args.lengths)
    bench.make_profile()
    draft = save_draft(bench)
    speculative = {"method": "eagle", "model": str(draft), "num_speculative_tokens": DRAFT_TOKENS}
    rng = random.Random(11)  # no pod holds these
    fresh = {n: [rng.randrange(VOCAB) for _ in range(n + SUFFIX)] for n in args.lengths}
    order = [(n, kind) for _ in range(args.repeats) for n in args.lengths for kind in ("restore", "prefill")]
    prompts = [bench.warm] + [bench.prompts[n] if kind == "restore" else fresh[n] for n, kind in order]
    bench.start_pod()
    bench.drive("eagle-save", [bench.warm] + [bench.prompts[n] for n in args.lengths], bench.connector(),
                speculative=speculative)
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for setting in SETTINGS:
        before = len(_events(bench, "restore"))
        cfg = bench.connector(save=False, profile=str(bench.profile))
        times = bench.drive(f"eagle-{setting}", prompts, cfg, speculative=speculative if setting == "eagle" else None)
        # the warm-up's restore (and draft rerun) first: left out
        restores, drafts = _events(bench, "restore")[before + 1:], _events(bench, "draft")[1:]
        timed = list(zip(order, times[1:], strict=True))
        rows[setting] = {n: {kind: median([t for key, t in timed if key == (n, kind)])
                             for kind in ("restore", "prefill")} for n in args.lengths}
        for n in args.lengths:
            mine = [r for r in restores if r["tokens"] == n]
            rows[setting][n]["restore_elapsed"] = median([r["elapsed_s"] for r in mine])
            rows[setting][n]["restored_chunks"] = sum(r["computed"] + r["loaded"] for r in mine)
            if setting == "eagle":
                rows[setting][n]["draft_elapsed"] = median([d["elapsed_s"] for d in drafts if d["tokens"] == n])
        print(json.dumps({setting: rows[setting]}), flush=True)
    assert bench.pod is not None
    bench.pod.stop()
    stored = dict(zip(args.lengths, bench.first_tokens["eagle-save"][1:], strict=True))  # vLLM computed these
    matches = all(token == stored[n] for setting in SETTINGS
                  for (n, kind), token in zip(order, bench.first_tokens[f"eagle-{setting}"][1:], strict=True)
                  if kind == "restore")
    return {"rows": {s: {str(n): r for n, r in by_n.items()} for s, by_n in rows.items()},
            "summary": {**summarize(rows, args.lengths), "next_token_matches": matches},
            "first_tokens": bench.first_tokens}


def _events(bench: Bench, kind: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, bench.stats.read_text().splitlines()) if e["event"] == kind] \
        if bench.stats.exists() else []


def summarize(rows: dict[str, dict[int, dict[str, float]]], lengths: Sequence[int]) -> dict[str, Any]:
    """Per length (as a string, JSON's keys): the ratios the report shows."""
    eagle, plain = rows["eagle"], rows["plain"]
    return {
        "restore_vs_prefill_with_draft": {str(n): eagle[n]["restore"] / eagle[n]["prefill"] for n in lengths},
        "restore_vs_prefill_without_draft": {str(n): plain[n]["restore"] / plain[n]["prefill"] for n in lengths},
        "draft_adds_to_restore": {str(n): eagle[n]["restore"] / plain[n]["restore"] for n in lengths},
        "draft_adds_to_prefill": {str(n): eagle[n]["prefill"] / plain[n]["prefill"] for n in lengths},
        "draft_rerun_share_of_restore": {str(n): eagle[n]["draft_elapsed"] / eagle[n]["restore_elapsed"]
                                         for n in lengths},
        "every_prompt_restored": all(rows[s][n]["restored_chunks"] > 0 for s in SETTINGS for n in lengths),
    }


def report(body: dict[str, Any]) -> str:
    rows, s = body["rows"], body["summary"]
    table = [[n, f"{rows['eagle'][n]['prefill']:.3f}", f"{rows['eagle'][n]['restore']:.3f}",
              f"{rows['eagle'][n]['draft_elapsed'] * 1e3:.1f} / {rows['eagle'][n]['restore_elapsed'] * 1e3:.1f}",
              f"{rows['plain'][n]['prefill']:.3f}", f"{rows['plain'][n]['restore']:.3f}",
              f"**{s['restore_vs_prefill_with_draft'][n]:.2f}**", f"{s['restore_vs_prefill_without_draft'][n]:.2f}",
              f"{s['draft_adds_to_restore'][n]:.2f}", f"{s['draft_adds_to_prefill'][n]:.2f}"]
             for n in rows["eagle"]]
    head = ["prefix", "prefill, draft (s)", "restore, draft (s)", "of it: draft rerun / restore (ms)",
            "prefill, no draft (s)", "restore, no draft (s)", "restore / prefill, draft", "restore / prefill, no draft",
            "draft's cost: restore", "draft's cost: prefill"]
    return "\n".join([
        "# An EAGLE draft's cost in a restore (vLLM, CPU)", "", f"`{body['command']}`", "",
        " ".join(__doc__.split("\n\n", 2)[2].split()), "", markdown_table(head, table), "",
        f"Every measured prompt restored (both settings): {s['every_prompt_restored']}; its greedy next token "
        f"the one vLLM computed when it stored it: {s['next_token_matches']}.", ""])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cacheflow bench vllm-eagle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096", help="cached prefix lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per prompt and setting")
    parser.add_argument("--quick", action="store_true", help="one 512-token prefix, one timing each (a smoke run)")
    parser.add_argument("--workdir", default=str(SCRATCH_DIR / "vllm_eagle"), help="working folder")
    add_out_option(parser)
    args = parser.parse_args(argv)
    require_vllm(parser)
    args.lengths = [512] if args.quick else [int(x) for x in args.lengths.split(",")]
    args.repeats = 1 if args.quick else args.repeats
    return publish(args, "vllm_eagle", {**provenance(args.quick), **run(args)}, report)


if __name__ == "__main__":
    raise SystemExit(main())
