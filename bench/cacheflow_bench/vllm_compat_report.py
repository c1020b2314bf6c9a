"""The vLLM compatibility matrix's summary, its Markdown report and the README table generated from
bench/results/vllm_compat.json (between its own markers, apart from the benchmark table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cacheflow_bench.common import markdown_table
from cacheflow_bench.readme_table import replace_block
from cacheflow_bench.tiny_models import FP8_FAMILIES

README = Path(__file__).resolve().parents[2] / "README.md"
BEGIN = "<!-- vllm-compat-table:begin -->"
END = "<!-- vllm-compat-table:end -->"
Cells = list[dict[str, Any]]


def variant_key(c: dict[str, Any]) -> tuple[str, int, str, int, str]:
    return c["family"], c["tp"], c["kv_dtype"], c.get("pp", 1), c.get("spec", "")


def cross_check(cells: Cells) -> None:
    """A LoRA cell's base-model pass must give the LoRA-off cell's cold tokens (same model, TP, KV dtype):
    where that cell ran, record it, and fail the LoRA cell if they differ."""
    base = {variant_key(c): c["base_tokens"] for c in cells
            if not c["lora"] and not c.get("stored_by") and "base_tokens" in c}
    for c in cells:
        if c["lora"] and "base_tokens" in c and variant_key(c) in base:
            c["base_equals_lora_off_cell"] = c["base_tokens"] == base[variant_key(c)]
            if not c["base_equals_lora_off_cell"]:
                c["status"] = "failed"


def lora_isolated(cells: Cells) -> bool | None:
    """No LoRA cell restored its base pass from the adapter's chunks, and every pass gave its reference's
    tokens; None if no LoRA cell ran."""
    ran = [c for c in cells if c["lora"] and c.get("start_ok")]
    if not ran:
        return None
    return all(not c.get("lora_leak") and c["tokens_equal"] and c.get("base_equals_lora_off_cell", True) for c in ran)


def summarize(cells: Cells) -> dict[str, Any]:
    restored = [c for c in cells if c["status"] == "ok" and c.get("outcome") == "restored"]
    families = sorted({c["family"] for c in restored if c["family"] not in FP8_FAMILIES})
    return {"cells": len(cells), "ok_cells": sum(c["status"] == "ok" for c in cells),
            "failed_cells": sum(c["status"] == "failed" for c in cells),
            "failed": [c["name"] for c in cells if c["status"] == "failed"],
            "vllm_cannot_run_cells": sum(c["status"] == "vllm_cannot_run" for c in cells),
            "restored_cells": len(restored), "declined_cells": sum(c.get("outcome") == "declined" for c in cells),
            "families_restored": len(families), "restored_families": families,
            "tp2_restored": any(c["tp"] == 2 for c in restored),
            "tp2_recomputed": any(c["tp"] == 2 and c.get("computed", 0) > 0 for c in restored),
            "fp8_kv_restored": any(c["kv_dtype"] == "fp8" for c in restored),
            "fp8_weights_restored": any(c["family"] in FP8_FAMILIES for c in restored),
            "lora_restored": any(c["lora"] for c in restored),
            "lora_recomputed": any(c["lora"] and c.get("computed", 0) > 0 for c in restored),
            "lora_isolated": lora_isolated(cells), "tp_sizes_share_chunks": tp_sizes_share(cells),
            "pp2_restored": any(c.get("pp", 1) == 2 for c in restored),
            "pp2_recomputed": any(c.get("pp", 1) == 2 and c.get("computed", 0) > 0 for c in restored),
            "pp2_families_restored": len({c["family"] for c in restored if c.get("pp", 1) == 2}),
            "tp_pp_families_restored": len({c["family"] for c in restored if c.get("pp", 1) > 1 and c["tp"] > 1}),
            **spec_summary(cells, restored)}


def spec_summary(cells: Cells, restored: Cells) -> dict[str, Any]:
    """Speculative decoding: the families restored under an n-gram draft and whether any were under Medusa heads
    (vLLM drafting in the restored pass), the outcomes of the cells whose draft has KV of its own (EAGLE,
    EAGLE-3, MTP, a draft model), and whether every restored draft-model and MTP cell drafted and accepted after
    its restore as after vLLM's own prefill (a draft model is the target itself: a wrong draft KV would show)."""
    drafted = [c for c in restored if c.get("drafts", 0) > 0]
    ngram = [c for c in drafted if c["spec"] == "ngram"]
    return {"ngram_families_restored": len({c["family"] for c in ngram}),
            "ngram_tp2_restored": any(c["tp"] == 2 for c in ngram),
            "medusa_restored": any(c["spec"] == "medusa" for c in drafted),
            **{f"{draft}_outcomes": sorted({c["status"] if c["status"] != "ok" else c.get("outcome", "none")
                                            for c in cells if c.get("spec") == draft})
               for draft in ("eagle", "eagle3", "mtp", "draft_model")},
            **{f"{draft}_drafts_as_vllm": drafts_as_cold([c for c in drafted if c["spec"] == draft])
               for draft in ("mtp", "draft_model")}}


def drafts_as_cold(cells: Cells) -> bool | None:
    """Every cell's draft counters in its restored pass equal its cold pass's (None if no cell drafted or
    recorded them)."""
    recorded = [c for c in cells if "drafts_as_cold" in c]
    return all(c["drafts_as_cold"] for c in recorded) if recorded else None


def tp_sizes_share(cells: Cells) -> bool | None:
    """Every sharing cell that vLLM could run restored the other TP size's chunks with its tokens, where its
    family restores at both sizes on its own (None if no such sharing cell ran)."""
    alone = {variant_key(c) for c in cells if not c.get("stored_by") and not c["lora"] and c["status"] == "ok"
             and c.get("outcome") == "restored"}
    due = [c for c in cells if c.get("stored_by") and c["status"] != "vllm_cannot_run" and variant_key(c) in alone
           and (c["family"], c["stored_by"], c["kv_dtype"], 1, "") in alone]
    if not due:
        return None
    return all(c["status"] == "ok" and c.get("outcome") == "restored" for c in due)


def one_line(text: str | None, limit: int = 200) -> str:
    """An error line, fit for a table cell."""
    return (text or "").replace("|", "/").replace("\n", " ")[:limit]


def detail(c: dict[str, Any]) -> str:
    drafts = f"; vLLM drafted {c['draft_tokens']} tokens, {c['accepted_tokens']} accepted" if "drafts" in c else ""
    if "drafts_as_cold" in c:
        drafts += " (as in the cold pass)" if c["drafts_as_cold"] else " (**not** as in the cold pass)"
    if c.get("outcome") == "restored":
        return f"computed {c['computed']}, loaded {c['loaded']}{drafts}"
    if c.get("outcome") == "declined":
        return "; ".join(c["reasons"]).replace("|", "/") + drafts
    return one_line(c.get("error"))


def yes_no(value: Any) -> str:
    return "—" if value is None else "yes" if value else "**no**"


def report(body: dict[str, Any]) -> str:
    """bench/results/vllm_compat.md: the summary, then one row per cell."""
    cells = body["cells"]
    rows = [[c["family"], tp_of(c), c["kv_dtype"], on_off(c["lora"]), c.get("spec") or "—", c["status"],
             yes_no(c["start_ok"]), yes_no(c.get("tokens_equal")), c.get("outcome", "—"), detail(c), c["wall_s"],
             c.get("commit") or body["machine"]["git"]] for c in cells]
    table = markdown_table(["family", "TP", "KV dtype", "LoRA", "draft", "status", "vLLM starts", "tokens equal",
                            "connector", "detail", "wall s", "commit"], rows)
    summary = "\n".join(f"- {k}: {v}" for k, v in body["summary"].items())
    return (f"# vLLM compatibility matrix (`cacheflow bench vllm-compat`)\n\n{body['command']}\n\n{summary}\n\n"
            f"{table}\n")


def tp_of(c: dict[str, Any]) -> str:
    """The cell's TP size, and a sharing cell's storing one: "2 (from 1)"; a PP size above 1: "1, PP 2"."""
    pipeline = f", PP {c['pp']}" if c.get("pp", 1) > 1 else ""
    return (f"{c['tp']} (from {c['stored_by']})" if c.get("stored_by") else str(c["tp"])) + pipeline


def split_name(tp: int, pp: int) -> str:
    """A column's parallel split: "TP 2", "PP 2" (at TP 1), "TP 2 × PP 2"."""
    return f"TP {tp} × PP {pp}" if tp > 1 and pp > 1 else f"PP {pp}" if pp > 1 else f"TP {tp}"


def short(c: dict[str, Any] | None) -> str:
    if c is None:
        return "not run"
    if c["status"] == "vllm_cannot_run":
        return "vLLM cannot run"
    if c["status"] == "failed":
        return "**FAILED**"
    return str(c["outcome"])


def block(body: dict[str, Any]) -> str:
    """The README's compatibility table: one row per family, one column per (TP, KV dtype, LoRA); the
    speculative cells in a table of their own, one column per (draft, TP, KV dtype)."""
    cells = [c for c in body["cells"] if not c.get("spec")]
    drafted = [c for c in body["cells"] if c.get("spec")]
    tables = [grid(cells)] + ([f"With speculative decoding (LoRA off):\n\n{grid(drafted, lora=False)}"] if drafted
                              else [])
    s = body["summary"]
    line = (f"{s['cells']} cells: {s['restored_cells']} restored, {s['declined_cells']} declined, "
            f"{s['failed_cells']} failed, {s['vllm_cannot_run_cells']} that vLLM's CPU build cannot run; "
            f"families restored {s['families_restored']}; TP 2 restored: {yes_no(s['tp2_restored'])} (with a "
            f"recomputed front: {yes_no(s.get('tp2_recomputed', False))}); fp8 KV "
            f"restored: {yes_no(s['fp8_kv_restored'])}; FP8 weights restored: {yes_no(s['fp8_weights_restored'])}; "
            f"LoRA isolated: {yes_no(s['lora_isolated'])} (recomputed under the adapter: "
            f"{yes_no(s.get('lora_recomputed', False))}); TP sizes share chunks: "
            f"{yes_no(s.get('tp_sizes_share_chunks'))}; PP 2 restored: {yes_no(s.get('pp2_restored', False))} "
            f"({s.get('pp2_families_restored', 0)} families; with a recomputed front: "
            f"{yes_no(s.get('pp2_recomputed', False))}); TP 2 × PP 2 restored: "
            f"{s.get('tp_pp_families_restored', 0)} families; with an n-gram draft restored: "
            f"{s.get('ngram_families_restored', 0)} families (TP 2: {yes_no(s.get('ngram_tp2_restored', False))}); "
            f"with Medusa heads restored: {yes_no(s.get('medusa_restored', False))}; "
            f"with an EAGLE draft: {', '.join(s.get('eagle_outcomes', [])) or 'not run'}; with an EAGLE-3 draft: "
            f"{', '.join(s.get('eagle3_outcomes', [])) or 'not run'}; with an MTP draft: "
            f"{', '.join(s.get('mtp_outcomes', [])) or 'not run'} (drafting as after vLLM's own prefill: "
            f"{yes_no(s.get('mtp_drafts_as_vllm'))}); with a draft model: "
            f"{', '.join(s.get('draft_model_outcomes', [])) or 'not run'} (drafting and accepting after the restore as "
            f"after vLLM's own prefill: {yes_no(s.get('draft_model_drafts_as_vllm'))}) ({commits(body)}, "
            "`cacheflow bench vllm-compat`; details in bench/results/vllm_compat.md).")
    return "\n".join([BEGIN, "\n\n".join(tables), "", line, END])


def grid(cells: Cells, lora: bool = True) -> str:
    """One row per family (with a draft: per family and draft), one column per configuration the cells ran
    (`lora`: naming LoRA off or on; the speculative cells run without)."""
    def row(c: dict[str, Any]) -> str:
        return f"{c['family']}, {c['spec']} draft" if c.get("spec") else c["family"]

    def column(c: dict[str, Any]) -> tuple[int, int, int, str, bool]:
        return c.get("pp", 1), c.get("stored_by", 0), c["tp"], c["kv_dtype"], c["lora"]

    columns = sorted({column(c) for c in cells})
    by = {(row(c), *column(c)): c for c in cells}
    header = ["family", *(f"{split_name(tp, pp)}{f' from TP {by_tp}' if by_tp else ''}, KV {kv}"
                          f"{f', LoRA {on_off(on)}' if lora else ''}" for pp, by_tp, tp, kv, on in columns)]
    rows = [[r, *(short(by.get((r, *col))) for col in columns)] for r in dict.fromkeys(map(row, cells))]
    return markdown_table(header, rows)


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def commits(body: dict[str, Any]) -> str:
    """`commit X`, or `commits X, Y` where a merged result's cells ran at several."""
    seen = sorted({c.get("commit") or body["machine"]["git"] for c in body["cells"]})
    return f"commit{'s' if len(seen) > 1 else ''} {', '.join(seen)}"


def update_readme(path: Path, body: dict[str, Any]) -> bool:
    """Replace the README's compatibility table with the one `body` gives; whether it changed."""
    return replace_block(path, block(body), BEGIN, END)
