"""What a speculative draft with KV of its own adds to a restore, on vLLM (CPU): the connector's restores and vLLM's
own prefills, with the draft and without it.

    cacheflow bench vllm-eagle [--draft eagle|draft_model] [--quick] [--lengths 1024,2048,4096] [--repeats 3]
                               [--out DIR]

The vLLM bench's model (random Qwen3, 8 layers, hidden 512, fp32) and a random one-layer draft for it: an EAGLE
head (`--draft eagle`, the default: `tiny_models.eagle_from` over its config; written to vllm_eagle.json), or a
draft model (`--draft draft_model`: a one-layer Qwen3 of the same width, 1/8 of the target's layers; written to
vllm_draft_model.json). One process stores each prompt's chunks with the draft on (KV and
the target's output rows and the draft's own KV). Then one process per setting — draft on, its KV loaded
with the chunks (`draft_kv.py`); draft on, rerun over the restored positions instead (`draft_kv: false`,
`draft.py`); draft off — alternates, per length, a stored prompt (the connector restores it: CacheFlow's policy
with a profile, the pod on loopback) and a fresh one of the same length (vLLM prefills it, with the draft on also
running its drafter over the prompt), after a warm-up. Each prompt asks for one token: its wall time is its time
to first token (with the draft on, the step that samples it also drafts). Medians of `repeats`; the connector's
stats give each restore's time and its draft's (the load of its KV, or its rerun).
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

DRAFTS = ("eagle", "draft_model")  # vLLM's speculative methods this bench measures
PLAIN = "plain"  # the setting without the draft; the one with it is named by its method
RERUN = "-rerun"  # the setting with the draft rerun instead of its stored KV loaded: the method's name and this
DRAFT_TOKENS = 3
TITLES = {"eagle": "An EAGLE draft", "draft_model": "A draft model"}


def save_draft(bench: Bench, method: str) -> Path:
    """A random one-layer draft of the bench's model: an EAGLE head (a Llama layer of its width), or a draft
    model (a one-layer Qwen3 of its config)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    if method == "draft_model":
        model = Qwen3ForCausalLM(Qwen3Config.from_dict({**MODEL, "num_hidden_layers": 1}))
        model.save_pretrained(bench.root / "draft_model", safe_serialization=True)
        return bench.root / "draft_model"
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings")
    settings: dict[str, Any] = {k: MODEL[k] for k in keys}
    config = LlamaConfig(**settings, num_hidden_layers=1, tie_word_embeddings=False)
    return tiny_models.eagle_from(LlamaForCausalLM(config), bench.root / "eagle")


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    bench = Bench(root, args.lengths)
    bench.make_profile()
    method = args.draft
    speculative = {"method": method, "model": str(save_draft(bench, method)), "num_speculative_tokens": DRAFT_TOKENS}
    rng = random.Random(11)  # no pod holds these
    fresh = {n: [rng.randrange(VOCAB) for _ in range(n + SUFFIX)] for n in args.lengths}
    order = [(n, kind) for _ in range(args.repeats) for n in args.lengths for kind in ("restore", "prefill")]
    prompts = [bench.warm] + [bench.prompts[n] if kind == "restore" else fresh[n] for n, kind in order]
    bench.start_pod()
    bench.drive("draft-save", [bench.warm] + [bench.prompts[n] for n in args.lengths], bench.connector(),
                speculative=speculative)
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for setting in (method, method + RERUN, PLAIN):
        before, drafted = len(_events(bench, "restore")), len(_events(bench, "draft"))
        cfg = bench.connector(save=False, profile=str(bench.profile), draft_kv=setting == method)
        times = bench.drive(f"draft-{setting}", prompts, cfg, speculative=None if setting == PLAIN else speculative)
        # the warm-up's restore (and its draft's) first: left out
        restores, drafts = _events(bench, "restore")[before + 1:], _events(bench, "draft")[drafted + 1:]
        timed = list(zip(order, times[1:], strict=True))
        rows[setting] = {n: {kind: median([t for key, t in timed if key == (n, kind)])
                             for kind in ("restore", "prefill")} for n in args.lengths}
        for n in args.lengths:
            mine = [r for r in restores if r["tokens"] == n]
            rows[setting][n]["restore_elapsed"] = median([r["elapsed_s"] for r in mine])
            rows[setting][n]["restored_chunks"] = sum(r["computed"] + r["loaded"] for r in mine)
            if setting != PLAIN:  # its draft's events, as many as its restores, in the same order
                own = [d for d in drafts if d["tokens"] + d["loaded"] == n]
                rows[setting][n]["draft_elapsed"] = median([d["elapsed_s"] for d in own])
                rows[setting][n]["draft_rerun_tokens"] = median([d["tokens"] for d in own])
        print(json.dumps({setting: rows[setting]}), flush=True)
    assert bench.pod is not None
    bench.pod.stop()
    stored = dict(zip(args.lengths, bench.first_tokens["draft-save"][1:], strict=True))  # vLLM computed these
    matches = all(token == stored[n] for setting in rows
                  for (n, kind), token in zip(order, bench.first_tokens[f"draft-{setting}"][1:], strict=True)
                  if kind == "restore")
    return {"draft": method, "rows": {s: {str(n): r for n, r in by_n.items()} for s, by_n in rows.items()},
            "summary": {**summarize(rows, method, args.lengths), "next_token_matches": matches},
            "first_tokens": bench.first_tokens}


def _events(bench: Bench, kind: str) -> list[dict[str, Any]]:
    return [e for e in map(json.loads, bench.stats.read_text().splitlines()) if e["event"] == kind] \
        if bench.stats.exists() else []


def summarize(rows: dict[str, dict[int, dict[str, float]]], method: str, lengths: Sequence[int]) -> dict[str, Any]:
    """Per length (as a string, JSON's keys): the ratios the report shows (`method`: the draft's setting)."""
    drafted, rerun, plain = rows[method], rows[method + RERUN], rows[PLAIN]
    return {
        "restore_vs_prefill_with_draft": {str(n): drafted[n]["restore"] / drafted[n]["prefill"] for n in lengths},
        "restore_vs_prefill_without_draft": {str(n): plain[n]["restore"] / plain[n]["prefill"] for n in lengths},
        "draft_adds_to_restore": {str(n): drafted[n]["restore"] / plain[n]["restore"] for n in lengths},
        "draft_adds_to_prefill": {str(n): drafted[n]["prefill"] / plain[n]["prefill"] for n in lengths},
        "draft_share_of_restore": {str(n): drafted[n]["draft_elapsed"] / drafted[n]["restore_elapsed"]
                                   for n in lengths},
        "restore_vs_prefill_with_draft_rerun": {str(n): rerun[n]["restore"] / rerun[n]["prefill"] for n in lengths},
        "draft_rerun_share_of_restore": {str(n): rerun[n]["draft_elapsed"] / rerun[n]["restore_elapsed"]
                                         for n in lengths},
        "loaded_vs_rerun_restore": {str(n): drafted[n]["restore"] / rerun[n]["restore"] for n in lengths},
        "draft_kv_loaded_whole": all(drafted[n]["draft_rerun_tokens"] == 0 for n in lengths),
        "every_prompt_restored": all(by_n[n]["restored_chunks"] > 0 for by_n in rows.values() for n in lengths),
    }


def report(body: dict[str, Any]) -> str:
    rows, s = body["rows"], body["summary"]
    method = body["draft"]
    drafted, rerun, plain = rows[method], rows[method + RERUN], rows[PLAIN]
    table = [[n, f"{drafted[n]['prefill']:.3f}", f"{drafted[n]['restore']:.3f}", f"{rerun[n]['restore']:.3f}",
              f"{drafted[n]['draft_elapsed'] * 1e3:.1f} / {rerun[n]['draft_elapsed'] * 1e3:.1f}",
              f"{plain[n]['prefill']:.3f}", f"{plain[n]['restore']:.3f}",
              f"**{s['restore_vs_prefill_with_draft'][n]:.2f}**", f"{s['restore_vs_prefill_with_draft_rerun'][n]:.2f}",
              f"{s['restore_vs_prefill_without_draft'][n]:.2f}", f"**{s['loaded_vs_rerun_restore'][n]:.2f}**"]
             for n in drafted]
    head = ["prefix", "prefill, draft (s)", "restore, draft's KV loaded (s)", "restore, draft rerun (s)",
            "of them: the draft's load / rerun (ms)", "prefill, no draft (s)", "restore, no draft (s)",
            "restore / prefill: KV loaded", "restore / prefill: rerun", "restore / prefill, no draft",
            "loaded / rerun"]
    return "\n".join([
        f"# {TITLES[method]}'s cost in a restore (vLLM, CPU)", "", f"`{body['command']}`", "",
        " ".join(__doc__.split("\n\n", 2)[2].split()), "", markdown_table(head, table), "",
        f"Every measured prompt restored (all settings): {s['every_prompt_restored']}; its greedy next token "
        f"the one vLLM computed when it stored it: {s['next_token_matches']}; the draft's KV of every restore "
        f"loaded whole (nothing rerun): {s['draft_kv_loaded_whole']}.", ""])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cacheflow bench vllm-eagle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", choices=DRAFTS, default="eagle", help="the draft: an EAGLE head or a draft model")
    parser.add_argument("--lengths", default="1024,2048,4096", help="cached prefix lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="timings per prompt and setting")
    parser.add_argument("--quick", action="store_true", help="one 512-token prefix, one timing each (a smoke run)")
    parser.add_argument("--workdir", default=str(SCRATCH_DIR / "vllm_eagle"), help="working folder")
    add_out_option(parser)
    args = parser.parse_args(argv)
    require_vllm(parser)
    args.lengths = [512] if args.quick else [int(x) for x in args.lengths.split(",")]
    args.repeats = 1 if args.quick else args.repeats
    return publish(args, f"vllm_{args.draft}", {**provenance(args.quick), **run(args)}, report)


if __name__ == "__main__":
    raise SystemExit(main())
