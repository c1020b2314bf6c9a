"""How vLLM's model runs a restore step's rows (`vllm_runtime.forward_groups`): forwards of at most vLLM's
token budget, a request cut between two in position order, and one LoRA adapter (or none) per forward; and
what a pipeline rank's forward takes and gives (`sent_between_ranks`, `residual_stream`). The forwards
themselves need vLLM: `test_step_aside.py` and `test_pipeline_ranks.py` run them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.model.transformer import Span
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.plan import Adapter
from cacheflow_services.vllm_connector.vllm_runtime import forward_groups, residual_stream, sent_between_ranks

BS = 8
A = Adapter("a", 1, "/adapters/a")


def _kv(adapter: Adapter | None = None) -> BlockKV:
    caches = {0: torch.zeros(4, 1, BS, 4)}  # [blocks, Hkv, block, 2D]
    return BlockKV(layers=range(1), num_kv_heads=1, head_dim=2, capacity=32, dtype=torch.float32, caches=caches,
                   layout="split", block_ids=range(4), block_size=BS, first_writable=0, adapter=adapter)


def _shape(groups: list[list[Span]]) -> list[list[tuple[int, int, int]]]:
    return [[(s.start, s.length, s.row) for s in group] for group in groups]


def test_a_step_within_the_budget_is_one_forward_its_rows_packed_in_order() -> None:
    spans = [Span(_kv(), 16, 24), Span(_kv(), 0, 8)]  # the callers' spans leave `row` at 0
    assert _shape(forward_groups(spans, 32)) == [[(16, 24, 0), (0, 8, 24)]]


def test_rows_past_the_budget_go_to_the_next_forward_a_request_cut_in_position_order() -> None:
    first, second = _kv(), _kv()
    groups = forward_groups([Span(first, 16, 24), Span(second, 0, 30)], 20)
    assert _shape(groups) == [[(16, 20, 0)], [(36, 4, 20), (0, 16, 24)], [(16, 14, 40)]]
    assert [[s.kv for s in g] for g in groups] == [[first], [first, second], [second]]
    assert all(sum(s.length for s in g) <= 20 for g in groups)


def test_each_forward_runs_under_one_adapter() -> None:
    base, lora, base2 = _kv(), _kv(A), _kv()
    groups = forward_groups([Span(base, 0, 8), Span(lora, 0, 8), Span(base2, 0, 8)], 64)
    assert [[s.kv for s in g] for g in groups] == [[base], [lora], [base2]]
    assert _shape(groups) == [[(0, 8, 0)], [(0, 8, 8)], [(0, 8, 16)]]


class Sent:
    """Stands in for vLLM's IntermediateTensors (its `tensors` dict) and a model that makes them."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors


class Model:
    def __init__(self, *keys: str) -> None:
        self.keys = keys

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype, device: Any) -> Sent:
        return Sent({k: torch.zeros(batch_size, 4, dtype=dtype) for k in self.keys})


def test_a_later_rank_takes_a_residual_stream_and_nothing_else() -> None:
    cpu = torch.device("cpu")
    assert sent_between_ranks(Model("residual", "hidden_states"), torch.float32, cpu) == ("hidden_states", "residual")
    assert sent_between_ranks(Model("hidden_states"), torch.float32, cpu) == ("hidden_states",)
    for unknown in (Model("hidden_states", "aux_hidden_states"), Model(), object()):
        with pytest.raises(ConfigError, match="between pipeline ranks"):
            sent_between_ranks(unknown, torch.float32, cpu)


def test_a_ranks_output_is_its_residual_stream_or_the_last_ranks_hidden_states() -> None:
    hidden, residual = torch.randn(3, 4), torch.randn(3, 4)  # [rows, hidden]
    assert torch.equal(residual_stream(Sent({"hidden_states": hidden, "residual": residual})), hidden + residual)
    assert torch.equal(residual_stream(Sent({"hidden_states": hidden})), hidden)
    assert residual_stream(hidden) is hidden


class _Doubling:
    """Stands in for vLLM's model where only the rows' bookkeeping is tested: returns its input rows doubled."""

    def forward(self, *, input_ids: Any, positions: torch.Tensor, inputs_embeds: torch.Tensor) -> torch.Tensor:
        return 2 * inputs_embeds


def test_each_forward_keeps_a_requests_output_rows_by_position_for_its_draft(monkeypatch: Any) -> None:
    """An EAGLE draft restores from the rows vLLM's model returned at each position: `_forward` hands each
    request its own rows, in a forward whose packing starts past row 0 (the second of a cut step) too."""
    from contextlib import contextmanager

    from cacheflow_services.vllm_connector.vllm_runtime import VllmRuntime

    runtime = VllmRuntime.__new__(VllmRuntime)
    runtime.module, runtime._sent = _Doubling(), ()

    @contextmanager
    def no_context(spans: list[Span]) -> Any:
        yield torch.cat([torch.arange(s.start, s.start + s.length) for s in spans])

    monkeypatch.setattr(runtime, "forward_context", no_context)
    first, second = _kv(), _kv()
    first.keep_outputs()
    second.keep_outputs()
    rows = torch.arange(54.0).unsqueeze(1)  # [54, 1]: row r holds r
    for group in forward_groups([Span(first, 16, 24), Span(second, 0, 30)], 20):
        runtime._forward(rows[group[0].row : group[-1].row + group[-1].length], group)
    kept_first, kept_second = first.outputs(16, 40), second.outputs(0, 30)
    assert kept_first is not None and torch.equal(kept_first, 2 * rows[:24])
    assert kept_second is not None and torch.equal(kept_second, 2 * rows[24:])
    assert second.outputs(0, 31) is None and first.outputs(8, 20) is None  # rows it never computed
