"""Speculative drafts' KV restored under a LoRA adapter, on real vLLM (CPU) processes over a real storage pod.

vLLM applies an adapter to the target model only: its draft (an EAGLE head, an MTP layer, a draft model) runs
with the base weights, over the adapted target's rows (EAGLE, MTP) or the tokens (a draft model). A restore
under the adapter recomputes its front with vLLM's model under it (`adapters.py`), takes the rows of loaded
chunks from the adapter's own chunks (its keys are salted by the adapter), and reruns the draft under the
same LoRA mapping as the recompute (a draft sharing the target's embedding reads it as vLLM's step does).

The drafts copy their one-layer targets (`tiny_models.save_copying_eagle`, `save_copying_mtp`) and the adapter
is weak (B drawn at 0.005): it changes the greedy tokens, yet the base-weight draft still agrees with the
adapted target often, so a wrong draft KV shows in vLLM's counters (measured with EAGLE and the connector's
draft pass left out: 68 of 87 drafted tokens accepted against 67 of 90). A fresh warm process under the
adapter must draft and accept exactly as vLLM did after its own prefill, and give its tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cacheflow_bench import tiny_models, vllm
from tests.bench.draft_runs import check_restored_as_cold, run_pods

pytestmark = pytest.mark.skipif(not vllm.VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")

WEAK = 0.005  # the adapter's B weights' standard deviation (tiny_models' default: 0.1)
PASSES = {"eagle": (("cold", True, 1), ("warm", True, 1), ("tp2-warm", True, 2), ("base", True, 1)),
          "mtp": (("cold", True, 1), ("warm", True, 1)),
          "draft_model": (("cold", True, 1), ("warm", True, 1))}  # (name, with the draft, TP); "base": no adapter


FAMILY = {"eagle": "llama", "mtp": "mimo", "draft_model": "llama"}  # the copying target's family, by method


def models(method: str, root: Path) -> tuple[Path, Path]:
    """The copying target and draft for `method`."""
    if method == "mtp":
        target = tiny_models.save_copying_mtp(FAMILY[method], root / "mimo")
        return target, target
    target, eagle = tiny_models.save_copying_eagle(root / "target", root / "eagle")
    return target, eagle if method == "eagle" else target


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per method, over a pod of its own, with LoRA on: cold (vLLM's own prefill under the adapter, with the
    draft; stores), then fresh warm processes that restore under it; for EAGLE also at TP 2, and the base model
    after them."""
    out = {}
    for method, passes in PASSES.items():
        root = tmp_path_factory.mktemp(f"lora-{method}")
        pair = models(method, root)
        adapter = tiny_models.save_lora(FAMILY[method], pair[0], root / "adapter", b_std=WEAK)
        out[method] = run_pods(root, {"pod": passes}, pair, method=method, adapter=adapter)
    return out


@pytest.mark.parametrize("method", list(PASSES))
def test_a_draft_restored_under_an_adapter_drafts_and_is_accepted_as_after_vllms_own_prefill(
        runs: dict[str, dict[str, Any]], method: str) -> None:
    cold = runs[method]["cold"]
    assert 0 < cold["drafts"]["accepted_tokens"] < cold["drafts"]["draft_tokens"]  # the adapter shows
    for name, _, tp in PASSES[method][1:]:
        if name != "base":
            check_restored_as_cold(cold, runs[method][name], tp, rows=method != "draft_model")


def test_the_adapter_changes_the_tokens_and_its_chunks_serve_no_base_request(runs: dict[str, dict[str, Any]]) -> None:
    base = runs["eagle"]["base"]
    assert base["tokens"] != runs["eagle"]["cold"]["tokens"]
    assert not [e for e in base["events"] if e["event"] in ("restore", "draft")]
