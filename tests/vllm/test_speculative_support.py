"""Which speculative decoding methods the connector serves, decided from vLLM's config alone: a draft without
KV of its own (n-gram or suffix lookups, Medusa or MLP heads) leaves the target's cache the whole of the KV,
so the connector serves it; an EAGLE or EAGLE-3 draft's KV, an MTP layer's or a draft model's, it restores by
rerunning the draft (with vLLM's model, without pipeline parallelism: tests/bench/test_eagle_restore.py,
test_mtp_restore.py, test_draft_model_restore.py and, under LoRA, test_draft_lora_restore.py run them); any
other draft with KV of its own (DFlash, MTP layers vLLM runs with proposers of their own) makes it step aside,
naming it. The config here is a stand-in with the fields `unsupported` reads (vLLM's `VllmConfig` needs vLLM,
which this environment does not have); the real vLLM runs both kinds in tests/bench/test_vllm_compat_smoke.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from cacheflow_services.vllm_connector.support import (
    KV_FREE_DRAFTS,
    draft_reads_output,
    draft_reads_rows,
    draft_sources,
    restores_draft,
    unsupported,
)


def vllm_config(method: str | None, *, tp: int = 1, pp: int = 1, lora: bool = False, mtp_type: str = "mimo_mtp"
                ) -> Any:
    parallel = SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                               tensor_parallel_size=tp, pipeline_parallel_size=pp)
    model = SimpleNamespace(use_mla=False, uses_mrope=False, is_encoder_decoder=False, quantization=None)
    return SimpleNamespace(parallel_config=parallel, cache_config=SimpleNamespace(cache_dtype="auto"),
                           model_config=model, lora_config=SimpleNamespace() if lora else None,
                           speculative_config=None if method is None else SimpleNamespace(
                               method=method, draft_model_config=SimpleNamespace(
                                   hf_config=SimpleNamespace(model_type=mtp_type))))


@pytest.mark.parametrize("method", KV_FREE_DRAFTS)
def test_drafts_without_kv_of_their_own_are_served(method: str) -> None:
    assert unsupported(vllm_config(method), "unused", "vllm") == ""


@pytest.mark.parametrize(("method", "reads_rows", "reads_output"), [
    ("eagle", True, True), ("mtp", True, True), ("eagle3", True, False), ("draft_model", False, False)])
@pytest.mark.parametrize(("tp", "lora"), [(1, False), (2, False), (1, True)])
def test_an_eagle_or_mtp_draft_or_a_draft_model_is_served_with_vllms_model_and_its_kv_restored(
        method: str, reads_rows: bool, reads_output: bool, tp: int, lora: bool) -> None:
    """An EAGLE or MTP draft reads the target's output rows (stored with the chunks), an EAGLE-3 draft the
    residual streams at its auxiliary layers, a draft model the tokens alone; with LoRA too."""
    config = vllm_config(method, tp=tp, lora=lora)
    assert unsupported(config, "unused", "vllm") == "" and restores_draft(config) == method
    assert (draft_reads_rows(config), draft_reads_output(config)) == (reads_rows, reads_output)
    assert restores_draft(vllm_config("ngram")) == restores_draft(vllm_config(None)) == ""


@pytest.mark.parametrize("method", ["eagle", "mtp", "draft_model"])
@pytest.mark.parametrize(("settings", "runtime", "where"), [
    ({"pp": 2}, "vllm", "pipeline parallelism"), ({}, "cacheflow", "CacheFlow's runtime")])
def test_a_restored_draft_elsewhere_makes_the_connector_step_aside_saying_where(method: str, settings: dict[str, Any],
                                                                                runtime: str, where: str) -> None:
    reason = unsupported(vllm_config(method, **settings), "unused", runtime)
    assert reason.startswith(f"speculative decoding with {method} under {where}: ")


@pytest.mark.parametrize("method", ["dflash", "custom_class"])
def test_drafts_with_kv_of_their_own_or_unknown_make_the_connector_step_aside(method: str) -> None:
    reason = unsupported(vllm_config(method), "unused", "vllm")
    assert reason == f"speculative decoding with {method}: the draft's own KV is not in the chunks"


@pytest.mark.parametrize("mtp_type", ["gemma4_mtp", "step3p5_mtp"])
def test_mtp_layers_with_proposers_of_their_own_make_the_connector_step_aside(mtp_type: str) -> None:
    """vLLM feeds them otherwise than its EAGLE proposer does (the rows a restore reruns them over)."""
    reason = unsupported(vllm_config("mtp", mtp_type=mtp_type), "unused", "vllm")
    assert reason.startswith(f"speculative decoding with {mtp_type} layers: ")


def test_no_speculative_decoding_is_served() -> None:
    assert unsupported(vllm_config(None), "unused", "vllm") == ""


@pytest.mark.parametrize(("method", "hf_config", "sources"), [
    ("eagle", {}, [(12, "output")]), ("mtp", {}, [(12, "output")]), ("draft_model", {}, []),
    ("eagle3", {}, [(2, "hidden"), (6, "hidden"), (9, "hidden")]),  # vLLM's default: 2, L // 2, L - 3
    ("eagle3", {"eagle_aux_hidden_state_layer_ids": [5, 1, 10]}, [(1, "hidden"), (5, "hidden"), (10, "hidden")]),
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3]}}, [(0, "hidden"), (3, "hidden")])])
def test_the_rows_a_chunk_needs_for_a_restored_draft_are_those_the_draft_reads(
        method: str, hf_config: dict[str, Any], sources: list[tuple[int, str]]) -> None:
    """What the scheduler's lookup asks each chunk for (12 layers): an EAGLE or MTP draft's output rows; an
    EAGLE-3 draft's boundary activations at the auxiliary layers vLLM's runner picks (its draft config's, else
    the model's default), in layer order; a draft model's none."""
    config = vllm_config(method)
    config.speculative_config.draft_model_config.hf_config = SimpleNamespace(**hf_config)
    assert draft_sources(config, 12) == sources
