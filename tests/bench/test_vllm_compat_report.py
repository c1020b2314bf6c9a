"""The compatibility matrix's bookkeeping without vLLM: a cell's outcome from the connector's stats events,
the summary's targets, the LoRA cross-check, and the README table against the committed result."""

from __future__ import annotations

import json
from typing import Any

from cacheflow_bench import vllm_compat_report as rep
from cacheflow_bench.common import RESULTS_DIR
from cacheflow_bench.readme_table import current_block
from cacheflow_bench.vllm_compat_cell import PREFIXES, Cell, error_line, judge, outcome, pass_of


def test_outcome_is_restored_declined_or_none_from_the_stats_events():
    restore = {"event": "restore", "computed": 2, "loaded": 3}
    assert outcome([restore, {**restore, "computed": 1}]) == {"outcome": "restored", "computed": 3, "loaded": 6}
    assert outcome([{"event": "restore", "computed": 0, "loaded": 0}])["outcome"] == "none"
    declined: list[dict[str, Any]] = [{"event": "inactive", "role": "worker", "reason": "sliding window"},
                {"event": "declined", "req": "warm-3", "reason": "LoRA"}, {"event": "save", "chunks": 4}]
    assert outcome(declined) == {"outcome": "declined", "reasons": ["LoRA", "sliding window"]}
    assert outcome([{"event": "save", "chunks": 4}]) == {"outcome": "none"}


def test_requests_belong_to_the_pass_whose_label_they_carry():
    labels = ["lora-warm", "lora-cold", "base-warm"]
    assert pass_of("lora-warm-7-1a2b", labels) == "lora-warm"
    assert pass_of("base-warm-9", labels) == "base-warm"
    assert pass_of("warm-9", labels) is None


def cell(family="llama", tp=1, kv="auto", lora=False, status="ok", out="restored", **extra):
    return {"family": family, "tp": tp, "kv_dtype": kv, "lora": lora, "status": status, "outcome": out,
            "name": f"{family}-tp{tp}-{kv}-{'lora' if lora else 'base'}", "start_ok": status != "vllm_cannot_run",
            "tokens_equal": True, "computed": 1, "loaded": 2, "reasons": ["r"], "wall_s": 1.0, **extra}


def test_summary_counts_restored_families_and_each_target():
    cells = [cell(), cell(kv="fp8"), cell("gemma2", out="declined"), cell("llama_fp8", tp=2),
             cell("deepseek_v2", status="vllm_cannot_run", out=None, error="boom"),
             cell("qwen2", status="failed", tokens_equal=False)]
    s = rep.summarize(cells)
    assert s["families_restored"] == 1 and s["restored_families"] == ["llama"]  # FP8 weights are no family
    assert (s["failed_cells"], s["failed"], s["vllm_cannot_run_cells"]) == (1, ["qwen2-tp1-auto-base"], 1)
    assert s["tp2_restored"] and s["fp8_kv_restored"] and s["fp8_weights_restored"]
    assert s["lora_isolated"] is None and not s["lora_restored"] and not s["lora_recomputed"]
    loaded_only, recomputed = cell(lora=True, computed=0), cell(lora=True, kv="fp8")
    assert rep.summarize([loaded_only])["lora_restored"] and not rep.summarize([loaded_only])["lora_recomputed"]
    assert rep.summarize([loaded_only, recomputed])["lora_recomputed"]


def test_a_lora_cell_whose_base_pass_differs_from_the_lora_off_cell_fails_and_breaks_isolation():
    base = cell(base_tokens=[[1, 2]])
    good = cell(lora=True, base_tokens=[[1, 2]], lora_leak=False, kv="auto")
    other = cell(lora=True, kv="fp8", base_tokens=[[7]], lora_leak=False)  # no LoRA-off fp8 cell to compare
    cells = [base, good, other]
    rep.cross_check(cells)
    assert good["base_equals_lora_off_cell"] and "base_equals_lora_off_cell" not in other
    assert rep.lora_isolated(cells) is True
    bad = cell(lora=True, base_tokens=[[2, 1]], lora_leak=False)
    rep.cross_check([base, bad])
    assert bad["status"] == "failed" and rep.lora_isolated([base, bad]) is False
    assert rep.lora_isolated([cell(lora=True, lora_leak=True)]) is False


def test_the_readme_table_has_a_row_per_family_and_a_column_per_configuration(tmp_path):
    cells = [cell(), cell(lora=True, out="declined", lora_leak=False),
             cell("phi3", status="vllm_cannot_run", out=None, error="x"), cell("phi3", lora=True, status="failed")]
    body = {"cells": cells, "summary": rep.summarize(cells), "machine": {"git": "abc1234"}, "command": "c"}
    table = rep.block(body)
    assert "| family | TP 1, KV auto, LoRA off | TP 1, KV auto, LoRA on |" in table
    assert "| llama | restored | declined |" in table and "| phi3 | vLLM cannot run | **FAILED** |" in table
    assert "(commit abc1234, " in table and "phi3-tp1" in rep.report(body)
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{rep.BEGIN}\nold\n{rep.END}\nafter\n")
    assert rep.update_readme(readme, body) and not rep.update_readme(readme, body)
    assert readme.read_text() == f"before\n{table}\nafter\n"
    cells[0]["commit"] = "def5678"  # a cell of a merged result ran at another commit
    assert "(commits abc1234, def5678, " in rep.block(body)


def test_the_committed_readme_compat_table_is_the_one_the_committed_result_gives():
    """A README that disagrees with bench/results/vllm_compat.json fails here: rerun the matrix."""
    result = RESULTS_DIR / "vllm_compat.json"
    expected = rep.block(json.loads(result.read_text())) if result.exists() else f"{rep.BEGIN}\n{rep.END}"
    assert current_block(rep.README.read_text(), rep.BEGIN, rep.END) == expected


def test_sharing_cells_count_where_their_family_restores_at_both_tp_sizes():
    def shared(family="llama", tp=2, by=1, **extra):
        return cell(family, tp=tp, stored_by=by, name=f"{family}-tp{tp}-auto-base-from-tp{by}", **extra)

    alone = [cell(), cell(tp=2), cell("deepseek_v2", out="declined"), cell("deepseek_v2", tp=2, out="declined")]
    assert rep.summarize(alone)["tp_sizes_share_chunks"] is None  # no sharing cell ran
    cells = [*alone, shared(), shared(tp=1, by=2), shared("deepseek_v2", out="declined")]  # MLA: declined alone too
    assert rep.summarize(cells)["tp_sizes_share_chunks"] is True
    host = shared(status="vllm_cannot_run", out=None)  # vLLM cannot run it here at all: no connector's failure
    assert rep.summarize([*cells, host])["tp_sizes_share_chunks"] is True
    assert rep.summarize([*alone, host])["tp_sizes_share_chunks"] is None
    assert rep.summarize([*cells, shared(tp=1, by=2, out="none")])["tp_sizes_share_chunks"] is False
    assert rep.summarize([*alone, shared(status="failed")])["tp_sizes_share_chunks"] is False
    body = {"cells": cells, "summary": rep.summarize(cells), "machine": {"git": "abc1234"}, "command": "c"}
    assert "| TP 2 from TP 1, KV auto, LoRA off |" in rep.block(body)
    assert "| llama | 2 (from 1) | auto | off | — | ok |" in rep.report(body)
    rep.cross_check([shared(base_tokens=[[9]]), lora_cell := cell(tp=2, lora=True, base_tokens=[[1]])])
    assert "base_equals_lora_off_cell" not in lora_cell  # a sharing cell's tokens are the storing TP size's


def test_pipeline_cells_have_their_own_column_cross_check_and_summary():
    def piped(family="llama", **extra):
        return cell(family, pp=2, name=f"{family}-tp1-pp2-auto-base", **extra)

    cells = [cell(base_tokens=[[1]]), piped(base_tokens=[[2]]), piped("qwen2", computed=0),
             piped("gemma2", out="declined"), cell(pp=2, lora=True, base_tokens=[[2]], lora_leak=False)]
    rep.cross_check(cells)
    assert cells[-1]["base_equals_lora_off_cell"]  # checked against the PP 2 LoRA-off cell, not the PP 1 one
    s = rep.summarize(cells)
    assert s["pp2_restored"] and s["pp2_recomputed"] and s["pp2_families_restored"] == 2
    assert not rep.summarize(cells[:1])["pp2_restored"]
    assert not rep.summarize([cells[0], cells[2]])["pp2_recomputed"]  # loads only
    body = {"cells": cells, "summary": s, "machine": {"git": "abc1234"}, "command": "c"}
    table = rep.block(body)
    assert "| family | TP 1, KV auto, LoRA off | PP 2, KV auto, LoRA off | PP 2, KV auto, LoRA on |" in table
    assert "| gemma2 | not run | declined | not run |" in table
    assert "PP 2 restored: yes (2 families; with a recomputed front: yes)" in table
    assert "| llama | 1, PP 2 | auto | off | — | ok |" in rep.report(body)
    assert "TP 2 × PP 2 restored: 0 families" in table
    cells.append(cell(tp=2, pp=2, name="llama-tp2-pp2-auto-base"))  # four ranks: a column of its own
    body["summary"] = s = rep.summarize(cells)
    assert s["tp_pp_families_restored"] == 1 and s["pp2_families_restored"] == 2
    assert "| PP 2, KV auto, LoRA on | TP 2 × PP 2, KV auto, LoRA off |" in rep.block(body)


def test_pipeline_cells_run_after_the_others_at_each_tp_size():
    from argparse import Namespace

    from cacheflow_bench.vllm_compat import cells_of

    args = Namespace(tp=[1, 2], pp=[1, 2], families=["llama"], kv_dtypes=["auto"], lora=[False], share=True,
                     spec=[], only_spec=False)
    assert [c.name for c in cells_of(args)] == [
        "llama-tp1-auto-base", "llama-tp2-auto-base", "llama-tp1-auto-base-from-tp2", "llama-tp2-auto-base-from-tp1",
        "llama-tp1-pp2-auto-base", "llama-tp2-pp2-auto-base"]
    args.pp, args.tp = [2], [2]  # only the pipeline cells, at TP 2
    assert [(c.name, c.tp, c.pp) for c in cells_of(args)] == [("llama-tp2-pp2-auto-base", 2, 2)]


def test_speculative_cells_come_last_and_eagle_only_where_the_family_has_a_draft():
    from argparse import Namespace

    from cacheflow_bench.vllm_compat import cells_of

    args = Namespace(tp=[1], pp=[1, 2], families=["llama", "qwen2"], kv_dtypes=["auto"], lora=[False], share=False,
                     spec=["ngram", "medusa", "eagle"], only_spec=False)
    assert [c.name for c in cells_of(args)][-4:] == [
        "llama-tp1-auto-base-ngram", "qwen2-tp1-auto-base-ngram", "llama-tp1-auto-base-medusa",
        "llama-tp1-auto-base-eagle"]
    args.pp = [2]  # speculative cells run without pipeline parallelism only
    assert not any(c.spec for c in cells_of(args))
    args.pp, args.only_spec = [1], True
    assert [c.spec for c in cells_of(args)] == ["ngram", "ngram", "medusa", "eagle"]


def test_speculative_cells_have_their_own_columns_drafts_and_summary():
    def drafted(family="llama", spec="ngram", **extra):
        counts = {"drafts": 3, "draft_tokens": 9, "accepted_tokens": 2, **extra}
        return cell(family, spec=spec, name=f"{family}-tp1-auto-base-{spec}", **counts)

    cells = [cell(base_tokens=[[1]]), drafted(base_tokens=[[5]]), drafted("qwen2", tp=2, drafts=0),
             drafted(spec="eagle", out="declined", reasons=["speculative decoding with eagle"]),
             drafted(spec="medusa", drafts=0)]
    rep.cross_check(cells)  # a speculative cell's prompts differ: it is no base for the others, nor checked
    s = rep.summarize(cells)
    assert s["ngram_families_restored"] == 1 and not s["ngram_tp2_restored"]  # qwen2 restored, but vLLM never drafted
    assert s["eagle_outcomes"] == ["declined"] and not s["medusa_restored"]  # restored, but vLLM never drafted
    body = {"cells": cells, "summary": s, "machine": {"git": "abc1234"}, "command": "c"}
    table = rep.block(body)
    assert "| family | TP 1, KV auto, LoRA off |\n" in table  # the plain cells' table, then the speculative ones'
    assert "With speculative decoding (LoRA off):\n\n| family | TP 1, KV auto | TP 2, KV auto |\n" in table
    assert "| llama, ngram draft | restored | not run |\n| qwen2, ngram draft | not run | restored |\n" \
        "| llama, eagle draft | declined | not run |\n| llama, medusa draft | restored | not run |" in table
    assert "with an n-gram draft restored: 1 families (TP 2: **no**); with Medusa heads restored: **no**; " \
        "with an EAGLE draft: declined" in table
    assert "| llama | 1 | auto | off | ngram | ok | yes | yes | restored | computed 1, loaded 2; vLLM drafted 9 " \
        "tokens, 2 accepted |" in rep.report(body)


def drafted_with(spec: str, family: str, as_cold: bool | None) -> dict:
    """A restored cell of `spec` whose warm pass drafted 9 tokens (`as_cold`: as its cold pass did; None: not
    recorded)."""
    recorded = {} if as_cold is None else {"drafts_as_cold": as_cold}
    return cell(family, spec=spec, name=f"{family}-tp1-auto-base-{spec}", drafts=3, draft_tokens=9,
                accepted_tokens=9, **recorded)


def test_draft_model_cells_say_whether_vllm_drafted_after_the_restore_as_after_its_own_prefill():
    def draft_model(family: str, as_cold: bool | None) -> dict:
        return drafted_with("draft_model", family, as_cold)

    assert rep.summarize([draft_model("llama", True), draft_model("qwen2", None)])["draft_model_drafts_as_vllm"]
    cells = [draft_model("llama", True), draft_model("qwen2", False)]
    s = rep.summarize(cells)
    assert s["draft_model_outcomes"] == ["restored"] and s["draft_model_drafts_as_vllm"] is False
    body = {"cells": cells, "summary": s, "machine": {"git": "abc1234"}, "command": "c"}
    assert "with a draft model: restored (drafting and accepting after the restore as after vLLM's own prefill: " \
        "**no**)" in rep.block(body)
    assert "9 accepted (**not** as in the cold pass) |" in rep.report(body)
    assert rep.summarize([cell()])["draft_model_drafts_as_vllm"] is None  # no draft-model cell ran


def test_mtp_cells_are_summarized_apart_from_draft_model_cells():
    cells = [drafted_with("mtp", "mimo", True), drafted_with("draft_model", "mimo", False)]
    s = rep.summarize(cells)
    assert (s["mtp_outcomes"], s["mtp_drafts_as_vllm"], s["draft_model_drafts_as_vllm"]) == (["restored"], True, False)
    body = {"cells": cells, "summary": s, "machine": {"git": "abc1234"}, "command": "c"}
    assert "with an MTP draft: restored (drafting as after vLLM's own prefill: yes)" in rep.block(body)


def test_a_speculative_cell_keeps_its_restored_passs_draft_counters_and_whether_they_are_the_cold_passs():
    cell_ = Cell("llama", 1, "auto", False, spec="draft_model")
    restore = {"event": "restore", "req": "warm-0-ab", "computed": 1, "loaded": 2}
    results = [{"tokens": [1, 2]}] * (2 * len(PREFIXES))  # the cold pass's prompts, then the warm pass's
    cold = {"drafts": 24, "draft_tokens": 72, "accepted_tokens": 71}
    for warm, as_cold in ((cold, True), ({**cold, "accepted_tokens": 69}, False)):
        counts = [cold, {name: cold[name] + warm[name] for name in cold}]  # vLLM's counters after each pass
        record = judge(cell_, {"results": results, "startup_s": 1.0, "spec_decode": counts}, [restore])
        assert record["outcome"] == "restored" and record["drafts_as_cold"] is as_cold
        assert {name: record[name] for name in cold} == warm


def test_a_failed_runs_error_is_its_last_specific_exception_and_whether_it_then_hung():
    log = ("INFO start\n(Worker_PP0) ERROR RuntimeError: Unsupported block size: 16\n"
           "(Worker_PP0) WARNING ValueError: not a cause\nINFO No available shared memory broadcast block\n")
    assert error_line(log) == "(Worker_PP0) ERROR RuntimeError: Unsupported block size: 16"
    assert error_line(log + "\ntimed out after 300 s\n") == \
        "(Worker_PP0) ERROR RuntimeError: Unsupported block size: 16 (timed out after 300 s)"
    assert error_line("INFO loading\ntimed out after 300 s\n") == "timed out after 300 s"
    engine_gone = ("(Worker_PP1 pid=7) ERROR [x.py:1] Traceback (most recent call last):\n"
                   "(Worker_PP1 pid=7) ERROR [x.py:1]     assert self.intermediate_tensors is not None\n"
                   "(Worker_PP1 pid=7) ERROR [x.py:1]            ^^^^^^^^^^^^\n"
                   "(Worker_PP1 pid=7) ERROR [x.py:1] AssertionError\n"
                   "(EngineCore pid=6) ERROR RuntimeError: Worker failed with error '', see above\n"
                   "Traceback (most recent call last):\nKeyError: 'lora-cold-0-b423019f'\n")
    assert error_line(engine_gone) == \
        "(Worker_PP1 pid=7) ERROR [x.py:1] AssertionError: self.intermediate_tensors is not None"
    assert error_line("a\nTraceback:\nKeyError: 'x'\n") == "KeyError: 'x'"
    assert error_line("INFO a\nsomething failed, error: x\nINFO b\n") == "something failed, error: x"
