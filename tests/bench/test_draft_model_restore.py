"""A draft model's KV restored with the target's (`"method": "draft_model"`), on real vLLM (CPU) processes over a
real storage pod.

The draft model is the target itself (a one-layer tiny Llama), so vLLM accepts every token it drafts after its
own prefill, and fewer where the draft's KV is wrong (measured with the connector's draft pass left out: 69 of
87 drafted tokens accepted against 72 of 72). A draft model reads the tokens alone, so chunks an instance
without the draft stored restore it too. Each warm process is fresh (nothing of the prompts in its cache): its
greedy tokens and vLLM's draft counters must equal those after vLLM's own prefill. CI runs TP 1; a draft model
at TP 2 (each rank loads its half of the draft's heads, as test_eagle_restore.py's TP 2 EAGLE draft does) is a
`cacheflow bench vllm-compat` cell.
"""

from __future__ import annotations

from typing import Any

import pytest

from cacheflow_bench import tiny_models, vllm
from cacheflow_bench.vllm_compat_cell import PREFIXES
from tests.bench.draft_runs import check_restored_as_cold, run_pods

pytestmark = pytest.mark.skipif(not vllm.VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")

PASSES = {"pod": (("cold", True, 1), ("warm", True, 1)),  # (name, with the draft, TP)
          "plain-pod": (("plain-cold", False, 1), ("plain-warm", True, 1))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Over one pod: cold (vLLM's own prefill, with the draft model; stores), then a warm restore.
    Over another: plain-cold (stores, without the draft), then plain-warm restores with it."""
    root = tmp_path_factory.mktemp("draft-model")
    target, _ = tiny_models.save_copying_eagle(root / "target", root / "eagle")
    return run_pods(root, PASSES, (target, target), method="draft_model")


@pytest.mark.parametrize("warm_name, rerun", [("warm", False), ("plain-warm", True)])
def test_a_restored_draft_model_drafts_and_is_accepted_as_after_vllms_own_prefill(
        runs: dict[str, Any], warm_name: str, rerun: bool) -> None:
    """warm loads the draft's KV cold stored; plain-warm restores chunks an instance without the draft stored (no
    draft KV with them): it reruns the draft model, which needs no rows of them."""
    cold, warm = runs["cold"], runs[warm_name]
    drafted, accepted = cold["drafts"]["draft_tokens"], cold["drafts"]["accepted_tokens"]
    assert accepted == drafted > 0  # the draft is its target: a wrong draft KV shows in its counters
    check_restored_as_cold(cold, warm, 1, rows=False, rerun=rerun)


def test_a_draft_model_stores_no_rows(runs: dict[str, Any]) -> None:
    """Its KV is a function of the tokens: a save with the draft model stores the target's chunks as one without it
    does, and no rows (the draft's own KV goes into objects of its own: `draft_save` events)."""
    saves = [e for e in runs["cold"]["events"] if e["event"] == "save"]
    plain = [e for e in runs["plain-cold"]["events"] if e["event"] == "save"]
    assert len(saves) == len(PREFIXES)
    stored = [[(e["chunks"], e["bytes"], e["tokens_end"]) for e in events] for events in (saves, plain)]
    assert stored[0] == stored[1]
