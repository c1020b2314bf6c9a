"""The memory benchmark's bookkeeping without vLLM: which runs it makes, and what a connector adds at each
tensor-parallel size (an instance's memory is the sum over its processes)."""

from __future__ import annotations

from typing import Any

from cacheflow_bench import vllm_memory as mem

MiB = 1 << 20


def _row(config: str, tp: int, repeat: int, live_mib: int) -> dict[str, Any]:
    figures = {key: live_mib * MiB for key in mem.MEMORY_KEYS}
    return {"config": config, "tp": tp, "repeat": repeat, **figures, "tokens": [[1]], "restores": 1,
            "runtime": [{"runtime": config.removeprefix("connector-")}]}


def test_a_tensor_parallel_instance_runs_vllm_alone_and_with_the_connectors_default():
    planned = mem.runs([1, 2], repeats=2)
    assert [name for tp, repeat, name in planned if tp == 1 and repeat == 0] == list(mem.CONFIGS)
    assert [(repeat, name) for tp, repeat, name in planned if tp == 2] == [
        (0, "vllm"), (0, "connector-vllm"), (1, "vllm"), (1, "connector-vllm")]


def test_each_tensor_parallel_size_is_compared_with_vllm_alone_at_that_size():
    weights = 1000 * MiB
    one = {"vllm": 0, "connector-vllm": 5, "connector-shared": 15, "connector-separate": 900}  # MiB added
    rows = [_row(name, 1, r, 4000 + extra + r) for r in range(3) for name, extra in one.items()]
    two = {"vllm": 0, "connector-vllm": 20}
    rows += [_row(name, 2, r, 5000 + extra) for r in range(3) for name, extra in two.items()]
    summary = mem.summarize({"rows": rows, "weight_bytes": weights})
    assert summary["added_trimmed_rss_fraction_of_weights"]["connector-vllm"] == 0.005
    assert summary["vllm_runtime_within_target"] and not summary["shared_within_target"]
    assert summary["tp2"] == {"rss_bytes": 0.02, "peak_rss_bytes": 0.02, "trimmed_rss_bytes": 0.02,
                              "within_target": False}
    assert "## Tensor parallel, 2 ranks" in "\n".join(mem.tp_lines({"rows": rows, "weight_bytes": weights,
                                                                     "summary": summary}))
