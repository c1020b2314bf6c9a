"""An MTP draft's KV restored with the target's (`"method": "mtp"`), on real vLLM (CPU) processes over a real
storage pod.

The model is a one-layer tiny MiMo (a Qwen2; GLM-4.5's MoE in the compatibility bench) whose
multi-token-prediction layer copies its target layer (`tiny_models.save_copying_mtp`): vLLM accepts every token
it drafts after its own prefill, and fewer where the MTP layer's KV is wrong (measured with the connector's draft
pass left out: 66 of 93 drafted tokens accepted against 72 of 72 on the MiMo, 59 of 111 on the GLM-4.5). vLLM
feeds an MTP layer as it does an EAGLE draft (its EAGLE proposer: the next token and the target's output row), so
the connector stores the output rows beside the chunks and reruns the layer over them. Each warm process is fresh
(nothing of the prompts in its cache): its greedy tokens and vLLM's draft counters must equal those after vLLM's
own prefill, at TP 1 and at TP 2 (from chunks and rows the TP 1 process stored; each rank reruns its half of the
layer's heads, in lockstep).
"""

from __future__ import annotations

from typing import Any

import pytest

from cacheflow_bench import tiny_models, vllm
from tests.bench.draft_runs import check_restored_as_cold, run_pods

pytestmark = pytest.mark.skipif(not vllm.VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")

PASSES = {"pod": (("cold", True, 1), ("warm", True, 1), ("tp2-warm", True, 2))}  # (name, with the draft, TP)


# CI's subset: the MiMo (a Qwen2). GLM-4.5's MoE MTP layer, at TP 1 and 2 with drafts counted as vLLM's, is a
# `cacheflow bench vllm-compat` cell (a vLLM process costs ~20 s on CI's 2 cores without AVX-512).
CI_FAMILIES = ("mimo",)


@pytest.fixture(scope="module", params=CI_FAMILIES)
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Over one pod: cold (vLLM's own prefill, with the MTP draft; stores), then warm restores at TP 1 and 2."""
    root = tmp_path_factory.mktemp(f"mtp-{request.param}")
    model = tiny_models.save_copying_mtp(request.param, root / request.param)
    return run_pods(root, PASSES, (model, model), method="mtp")


@pytest.mark.parametrize("warm_name, tp", [("warm", 1), ("tp2-warm", 2)])
def test_a_restored_mtp_layer_drafts_and_is_accepted_as_after_vllms_own_prefill(
        runs: dict[str, Any], warm_name: str, tp: int) -> None:
    cold, warm = runs["cold"], runs[warm_name]
    drafted, accepted = cold["drafts"]["draft_tokens"], cold["drafts"]["accepted_tokens"]
    assert accepted == drafted > 0  # the MTP layer copies its target: a wrong draft KV shows in its counters
    check_restored_as_cold(cold, warm, tp)
