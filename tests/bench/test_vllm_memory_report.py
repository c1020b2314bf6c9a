"""The memory benchmark's bookkeeping without vLLM: which runs it makes, and what a connector adds at each
tensor- and pipeline-parallel size (an instance's memory is the sum over its processes)."""

from __future__ import annotations

from typing import Any

from cacheflow_bench import readme_table
from cacheflow_bench import vllm_memory as mem
from cacheflow_services.vllm_connector import drive

MiB = 1 << 20


def _row(config: str, tp: int, repeat: int, live_mib: int, pp: int = 1) -> dict[str, Any]:
    """An instance of `live_mib` in every figure: a 500 MiB driver and its ranks' equal shares of the rest."""
    figures = {key: live_mib * MiB for key in mem.MEMORY_KEYS}
    ranks = tp * pp
    processes = [{key: 500 * MiB for key in mem.MEMORY_KEYS}] + [
        {key: (live_mib - 500) * MiB // ranks for key in mem.MEMORY_KEYS} for _ in range(ranks)]
    return {"config": config, "tp": tp, "pp": pp, "repeat": repeat, **figures, "processes": processes,
            "tokens": [[1]], "restores": 1, "saves": 1, "runtime": [{"runtime": config.removeprefix("connector-")}]}


def test_a_tensor_parallel_instance_runs_vllm_alone_with_the_reference_and_with_the_connectors_default():
    planned = mem.runs([1, 2], [1, 2], repeats=2)
    assert [name for size, repeat, name in planned if size == (1, 1) and repeat == 0] == list(mem.CONFIGS)
    for parallel in ((2, 1), (1, 2)):  # TP 2; PP 2 (at TP 1)
        assert [(repeat, name) for size, repeat, name in planned if size == parallel] == [
            (0, "vllm"), (0, "vllm-reference"), (0, "connector-vllm"),
            (1, "vllm"), (1, "vllm-reference"), (1, "connector-vllm")]
    assert [size for size, _, _ in mem.runs([1], [1], repeats=1)] == [(1, 1)] * len(mem.CONFIGS)


def test_each_tensor_parallel_size_is_compared_with_vllm_alone_at_that_size():
    weights = 1000 * MiB
    one = {"vllm": 0, "vllm-reference": 2, "connector-vllm": 5, "connector-shared": 15,
           "connector-separate": 900}  # MiB added
    rows = [_row(name, 1, r, 4000 + extra + r) for r in range(3) for name, extra in one.items()]
    two = {"vllm": 0, "vllm-reference": 12, "connector-vllm": 20}
    rows += [_row(name, 2, r, 5000 + extra) for r in range(3) for name, extra in two.items()]
    summary = mem.summarize({"rows": rows, "weight_bytes": weights})
    assert summary["added_trimmed_rss_fraction_of_weights"]["connector-vllm"] == 0.005
    assert summary["vllm_runtime_within_target"] and not summary["shared_within_target"]
    assert summary["tp2"] == {"rss_bytes": 0.02, "peak_rss_bytes": 0.02, "trimmed_rss_bytes": 0.02,
                              "heap_in_use_bytes": 0.02, "within_target": False,
                              "over_reference": {"rss_bytes": 0.008, "peak_rss_bytes": 0.008,
                                                 "trimmed_rss_bytes": 0.008, "heap_in_use_bytes": 0.008}}
    assert summary["connector_vllm_over_reference"]["trimmed_rss_bytes"] == 0.003
    text = "\n".join(mem.parallel_lines({"rows": rows, "weight_bytes": weights, "summary": summary}))
    assert "## Tensor parallel, 2 ranks" in text and "heap in use (MiB)" in text
    assert "adds +1.2% by itself" in text and "**+0.8%**" in text
    assert "(MiB; the driver, then each rank): vllm-reference +0, +6, +6; connector-vllm +0, +10, +10." in text
    piped = [_row(name, 1, r, 5000 + extra, pp=2) for r in range(3) for name, extra in {**two, "vllm": 10}.items()]
    summary = mem.summarize({"rows": rows + piped, "weight_bytes": weights})
    assert summary["pp2"]["trimmed_rss_bytes"] == 0.01 and summary["pp2"]["within_target"]
    assert summary["tp2"]["trimmed_rss_bytes"] == 0.02  # the PP rows are compared with vLLM alone at PP 2 only
    text = "\n".join(mem.parallel_lines({"rows": rows + piped, "weight_bytes": weights, "summary": summary}))
    assert text.index("## Tensor parallel, 2 ranks") < text.index("## Pipeline parallel, 2 ranks")


def test_the_reference_connectors_rows_are_not_counted_as_cacheflow_restores():
    rows = [{**_row(name, 1, 0, 4000), "restores": 0 if name == "vllm-reference" else 1,
             "runtime": [] if name == "vllm-reference" else [{"runtime": name.removeprefix("connector-")}]}
            for name in mem.CONFIGS if name != "vllm"]
    summary = mem.summarize({"rows": [_row("vllm", 1, 0, 4000), *rows], "weight_bytes": 1000 * MiB})
    assert summary["restores_ran"] and summary["saves_ran"] and summary["runtimes_as_configured"]
    rows[-1]["saves"] = 0  # a connector run that found its chunks already stored
    assert not mem.summarize({"rows": [_row("vllm", 1, 0, 4000), *rows], "weight_bytes": 1000 * MiB})["saves_ran"]


def test_wrong_tokens_of_the_reference_connector_are_reported_apart_from_cacheflows():
    rows = [_row(name, 1, 0, 4000 + 10 * n) for n, name in enumerate(mem.CONFIGS)]
    rows += [_row(name, 2, 0, 4000 + 10 * n) for n, name in enumerate(mem.TP_CONFIGS)]
    next(r for r in rows if r["tp"] == 2 and r["config"] == "vllm-reference")["tokens"] = [[7]]
    body = {"rows": rows, "weight_bytes": 1000 * MiB}
    body["summary"] = summary = mem.summarize(body)
    assert summary["same_tokens"] and not summary["reference_same_tokens"]
    assert "overwrite each other's heads" in "\n".join(mem.parallel_lines(body))
    assert "differ" not in mem.reference_line(body, "tp1", summary["connector_vllm_over_reference"])


def test_the_readme_row_gives_cacheflows_share_over_the_reference_connector_at_each_size():
    one = {"vllm": 0, "vllm-reference": 2, "connector-vllm": 5, "connector-shared": 4, "connector-separate": 900}
    two = {"vllm": 0, "vllm-reference": 12, "connector-vllm": 20}
    rows = [_row(name, 1, 0, 4000 + extra) for name, extra in one.items()]
    rows += [_row(name, 2, 0, 5000 + extra) for name, extra in two.items()]
    body = {"rows": rows, "weight_bytes": 1000 * MiB}
    body["summary"] = mem.summarize(body)
    headline, target = readme_table.vllm_memory_row(readme_table.Row("vllm_memory", body))
    assert "0.300 % over vLLM with its reference connector" in headline
    assert "a TP=2 instance (all its processes) **2.00 %** (2.00 % raw, heap in use 2.00 %)" in headline
    assert "0.800 % over vLLM with its reference connector" in headline and target == "≤ 1 % of the weights"
    rows += [_row(name, 1, 0, 6000 + extra, pp=2) for name, extra in two.items()]
    body["summary"] = mem.summarize(body)
    headline, _ = readme_table.vllm_memory_row(readme_table.Row("vllm_memory", body))
    assert "a PP=2 instance (all its processes) **2.00 %**" in headline


def test_a_run_spec_picks_cacheflows_connector_vllms_reference_one_or_none():
    cacheflow = drive.spec_transfer_config({"connector": {"tenant": "t"}})
    assert cacheflow is not None and cacheflow["kv_connector"] == "CacheFlowConnector"
    reference = drive.spec_transfer_config({"connector": None, "reference_connector": "/tmp/kv"})
    assert reference == {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}
    assert drive.spec_transfer_config({"connector": None, "reference_connector": None}) is None


def test_the_heap_in_use_counts_live_allocations_and_not_freed_ones():
    before = drive.process_memory()["heap_in_use_bytes"]
    live = bytearray(64 * MiB)  # one malloc'd block (mmapped at this size)
    held = drive.process_memory()
    assert held["heap_in_use_bytes"] - before >= 64 * MiB
    del live
    assert drive.process_memory()["heap_in_use_bytes"] < held["heap_in_use_bytes"] - 32 * MiB
