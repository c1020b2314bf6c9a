"""The vLLM compatibility matrix: tiny random checkpoints of the families vLLM users run (and an FP8-weight
one), each with TP 1 / 2 and PP 2, KV cache dtype auto / fp8 and LoRA off / on, through vLLM's CPU build with
the CacheFlow connector; and with speculative decoding (an n-gram draft, Medusa, EAGLE and EAGLE-3 drafts where
the family has one, and the target drafting for itself as a draft model).

    cacheflow bench vllm-compat [--families llama,gemma2] [--tp 1,2] [--pp 1,2] [--kv-dtypes auto,fp8]
                                [--lora off,on] [--share on] [--spec ngram,medusa,eagle,eagle3,draft_model]
                                [--only-spec] [--merge] [--out DIR] [--workdir DIR]

Each cell is one fresh vLLM process over its own storage pod (see vllm_compat_cell.py): a cold pass (vLLM
computes, the connector stores; the reference), then the same prompts again after the saves are flushed
and vLLM's prefix cache reset (the connector restores or declines); greedy tokens must be equal. A cell is
`ok`, `failed` (tokens differ, a load error, a LoRA leak, or vLLM fails to start only with the connector)
or `vllm_cannot_run` (vLLM's CPU build fails without the connector too: its own error is kept). With two
TP sizes, sharing cells (LoRA off) also restore at one TP size the chunks vLLM stored at the other. PP 2
cells run vLLM with torch.compile (drive.py says why): each rank restores its own layers. Speculative cells
(LoRA off, PP 1) run at each TP size and KV dtype. Writes
vllm_compat.{json,md}; with --merge, cells of an earlier vllm_compat.json that this run does not redo are
kept (each cell records the commit it ran at). Written to the committed results, the README's compatibility
table is regenerated from them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cacheflow_bench.common import RESULTS_DIR, SCRATCH_DIR, provenance, write_json
from cacheflow_bench.tiny_models import FAMILIES
from cacheflow_bench.vllm import require_vllm
from cacheflow_bench.vllm_compat_cell import SPEC_DRAFTS, Cell, has_draft, make_models, run_cell
from cacheflow_bench.vllm_compat_report import README, cross_check, report, summarize, update_readme

KV_DTYPES = ("auto", "fp8")


def cells_of(args: argparse.Namespace) -> list[Cell]:
    """TP 1 cells first (the ones that fit a short run), then by family; then the sharing cells; then the
    pipeline-parallel ones at each TP size (PP 2 at TP 1: two ranks, one core each; at TP 2, four ranks
    sharing the cores); the speculative ones last (`only_spec`: those alone)."""
    single = 1 in args.pp
    drafted = itertools.product(args.spec, args.tp if single else [], args.families, args.kv_dtypes)
    spec = [Cell(family, tp, kv, False, spec=spec) for spec, tp, family, kv in drafted
            if has_draft(family, spec)]
    if args.only_spec:
        return spec
    product = itertools.product(args.tp if single else [], args.families, args.kv_dtypes, args.lora)
    cells = [Cell(family, tp, kv, lora) for tp, family, kv, lora in product]
    shared = itertools.product(args.tp, args.tp, args.families, args.kv_dtypes) if args.share and single else []
    cells += [Cell(family, tp, kv, False, stored_by=by) for tp, by, family, kv in shared if by != tp]
    pipeline = itertools.product([pp for pp in args.pp if pp > 1], args.tp, args.families, args.kv_dtypes, args.lora)
    return cells + [Cell(family, tp, kv, lora, pp=pp) for pp, tp, family, kv, lora in pipeline] + spec


def merged(old: list[dict[str, Any]], new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`old` cells that `new` does not redo, then `new`'s, in the order of every family, TP, KV dtype, LoRA."""
    by_name = {c["name"]: c for c in old} | {c["name"]: c for c in new}
    order = {f: i for i, f in enumerate(FAMILIES)}
    return sorted(by_name.values(), key=lambda c: (c.get("spec", ""), c.get("pp", 1), c.get("stored_by", 0), c["tp"],
                                                   order.get(c["family"], len(order)), c["kv_dtype"], c["lora"]))


def earlier_cells(body: dict[str, Any]) -> list[dict[str, Any]]:
    """An earlier result's cells, each with the commit it ran at (older results name it only once)."""
    return [{"commit": body["machine"]["git"], **c} for c in body["cells"]]


def run(args: argparse.Namespace, out: Path, old: list[dict[str, Any]]) -> dict[str, Any]:
    """Every cell in turn; the result files rewritten after each (an interrupted run keeps what it did)."""
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    make_models(root, args.families)
    body: dict[str, Any] = {}
    new: list[dict[str, Any]] = []
    for cell in cells_of(args):
        new.append(run_cell(cell, root))
        print(json.dumps({k: v for k, v in new[-1].items() if k not in ("passes", "base_tokens", "log_tail")}),
              flush=True)
        body = write(out, merged(old, new))
    return body


def write(out: Path, cells: list[dict[str, Any]]) -> dict[str, Any]:
    cross_check(cells)
    body = {**provenance(False), "summary": summarize(cells), "cells": cells}
    write_json(out / "vllm_compat.json", body)
    (out / "vllm_compat.md").write_text(report(body))
    return body


def choices(value: str, allowed: Sequence[str], what: str, parser: argparse.ArgumentParser) -> list[str]:
    items = [x for x in value.split(",") if x]
    if not items:
        parser.error(f"{what} names none of {', '.join(allowed)}")
    if unknown := set(items) - set(allowed):
        parser.error(f"unknown {what} {sorted(unknown)}; choose from {', '.join(allowed)}")
    return items


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="cacheflow bench vllm-compat", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES), help="tiny checkpoints to run")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes")
    parser.add_argument("--pp", default="1,2", help="pipeline-parallel sizes (PP cells run at each --tp size)")
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES), help="vLLM's --kv-cache-dtype values")
    parser.add_argument("--lora", default="off,on", help="LoRA off, on, or both")
    parser.add_argument("--share", default="on", help="sharing cells across the TP sizes: on or off")
    parser.add_argument("--spec", default=",".join(SPEC_DRAFTS),
                        help="speculative cells' drafts (ngram, medusa, eagle, eagle3, mtp, draft_model), or off")
    parser.add_argument("--only-spec", action="store_true", help="only the speculative cells")
    parser.add_argument("--merge", action="store_true", help="keep the cells of an earlier result this run skips")
    parser.add_argument("--out", default=None, help=f"output directory (default: {RESULTS_DIR})")
    parser.add_argument("--workdir", default=str(SCRATCH_DIR / "vllm_compat"), help="working folder")
    args = parser.parse_args(argv)
    args.families = choices(args.families, list(FAMILIES), "--families", parser)
    args.tp = [int(x) for x in choices(args.tp, ["1", "2"], "--tp", parser)]
    args.pp = [int(x) for x in choices(args.pp, ["1", "2"], "--pp", parser)]
    args.kv_dtypes = choices(args.kv_dtypes, KV_DTYPES, "--kv-dtypes", parser)
    args.lora = [x == "on" for x in choices(args.lora, ["off", "on"], "--lora", parser)]
    args.share = choices(args.share, ["on", "off"], "--share", parser) == ["on"]
    args.spec = [] if args.spec == "off" else choices(args.spec, SPEC_DRAFTS, "--spec", parser)
    require_vllm(parser)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else RESULTS_DIR
    earlier = out / "vllm_compat.json"
    old = earlier_cells(json.loads(earlier.read_text())) if args.merge and earlier.exists() else []
    body = run(args, out, old)
    if out.resolve() == RESULTS_DIR.resolve():
        print(f"README table: {'rewritten' if update_readme(README, body) else 'already up to date'}")
    print(json.dumps(body["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
