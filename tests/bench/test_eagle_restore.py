"""An EAGLE draft's KV restored with the target's, on real vLLM (CPU) processes over a real storage pod.

The draft copies its one-layer target (`tiny_models.save_copying_eagle`): vLLM accepts nearly every token it
drafts after its own prefill, and fewer where the draft's KV is wrong (measured with the connector's draft pass
left out: 69 of 87 drafted tokens accepted against 72 of 72). A cold process computes the prompts and stores
their chunks (the target's output rows and the draft's own KV with them); a warm one, started fresh (nothing of
the prompts in its cache), restores them, loading the draft's KV; another reruns the draft instead (`draft_kv`
off): the greedy tokens and vLLM's draft counters of each must equal the cold process's, token for token; at TP 1
and at TP 2 (each rank loads, or reruns, its half of the draft's heads).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from cacheflow_bench import tiny_models, vllm
from cacheflow_bench.vllm_compat_cell import CHUNK, PREFIXES, prompts
from cacheflow_common.kv.chunk import decode_hidden_chunk
from tests.bench.draft_runs import check_restored_as_cold, run_pods

pytestmark = pytest.mark.skipif(not vllm.VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """cold (stores, with the draft) and warm (restores) over one pod; the same at TP 2 over another; plain-cold
    (stores, without the draft: no output rows) and plain-warm (restores with the draft) over a third."""
    root = tmp_path_factory.mktemp("eagle")
    models = tiny_models.save_copying_eagle(root / "target", root / "draft")
    passes = {"pod": (("cold", True, 1), ("warm", True, 1), ("rerun", True, 1)),
              "tp2-pod": (("tp2-cold", True, 2), ("tp2-warm", True, 2), ("tp2-rerun", True, 2)),
              "plain-pod": (("plain-cold", False, 1), ("plain-warm", True, 1))}  # (name, with the draft, TP)
    return {"models": models, **run_pods(root, passes, models)}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("rerun", [False, True])
def test_a_restored_draft_drafts_and_is_accepted_as_after_vllms_own_prefill(runs: dict[str, Any], tp: int,
                                                                            rerun: bool) -> None:
    """The draft's KV loaded as the cold process stored it, or (`rerun`: `draft_kv` off) rerun over the target's
    rows; at TP 2 each rank loads, or reruns, its half of the draft's heads, the ranks in lockstep."""
    prefix = "tp2-" if tp == 2 else ""
    cold, warm = runs[f"{prefix}cold"], runs[f"{prefix}{'rerun' if rerun else 'warm'}"]
    drafted, accepted = cold["drafts"]["draft_tokens"], cold["drafts"]["accepted_tokens"]
    assert accepted >= 0.9 * drafted > 0  # the copying draft is good: a wrong draft KV shows in its counters
    check_restored_as_cold(cold, warm, tp, rerun=rerun)


def test_the_stored_output_rows_are_the_targets_output(runs: dict[str, Any]) -> None:
    """Each chunk's `output` object holds what the target returns there (after its final norm), as transformers
    computes it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runs["models"][0], dtype=torch.float32)
    objects = sorted(Path(runs["pod-dir"]).rglob("*.output.L1-2.*"))
    assert len(objects) == sum(n // CHUNK for n in PREFIXES)
    outputs = {}
    with torch.no_grad():
        for prompt in prompts():
            outputs[tuple(prompt)] = model.model(torch.tensor([prompt])).last_hidden_state[0]  # [T, hidden]
    for path in objects:
        trailer, rows = decode_hidden_chunk(path.read_bytes())  # [C, hidden]
        start, end = trailer["token_start"], trailer["token_end"]
        expected = next(out[start:end] for prompt, out in outputs.items() if list(prompt[start:end]) ==
                        trailer["token_ids"])
        torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-4)


def test_chunks_stored_without_output_rows_are_left_to_vllm(runs: dict[str, Any]) -> None:
    """Chunks an instance without the draft stored have no output rows, which the draft cannot restore without:
    the scheduler's lookup does not count them, and vLLM computes the prompts (target and draft) itself."""
    check_left_to_vllm(runs)


def check_left_to_vllm(runs: dict[str, Any]) -> None:
    """plain-warm (with the draft) restored nothing of what plain-cold (without it) stored, not even a front:
    vLLM computed it all, with the tokens and draft counters of cold (with the draft, vLLM's own prefill)."""
    warm, cold = runs["plain-warm"], runs["cold"]
    assert sum(1 for e in runs["plain-cold"]["events"] if e["event"] == "save") == len(PREFIXES)  # chunks stored
    assert not [e for e in warm["events"] if e["event"] in ("restore", "draft", "load_error")]
    assert warm["tokens"] == runs["plain-cold"]["tokens"] == cold["tokens"]
    assert warm["drafts"] == cold["drafts"]


@pytest.fixture(scope="module")
def eagle3_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An EAGLE-3 draft (`tiny_models.save_eagle3`) over the two-layer tiny Llama: cold stores, warm restores;
    plain-cold stores without the draft, plain-warm runs with it over another pod."""
    root = tmp_path_factory.mktemp("eagle3")
    target = tiny_models.save("llama", root / "target")
    draft = tiny_models.save_eagle3("llama", root / "draft")
    passes = {"pod": (("cold", True, 1), ("warm", True, 1), ("rerun", True, 1)),
              "plain-pod": (("plain-cold", False, 1), ("plain-warm", True, 1))}
    return {"target": target, **run_pods(root, passes, (target, draft), method="eagle3")}


def test_an_eagle3_draft_is_restored_from_the_residual_streams_of_its_auxiliary_layers(
        eagle3_runs: dict[str, Any]) -> None:
    """The chunks hold the target's residual streams entering each auxiliary layer (boundary activations, as
    transformers computes them: the one past the last layer before the final norm); a process without the
    draft's stored KV (`draft_kv` off) restores the prefixes and reruns the draft over them, one with it loads
    the draft's KV: each with vLLM's tokens and draft counters."""
    from transformers import AutoModelForCausalLM

    cold = eagle3_runs["cold"]
    for name, expected in (("rerun", [(n, 0, 0) for n in PREFIXES]), ("warm", [(0, n, 0) for n in PREFIXES])):
        run = eagle3_runs[name]
        assert [(e["tokens"], e["loaded"], e["short"]) for e in run["events"] if e["event"] == "draft"] == expected
        assert run["tokens"] == cold["tokens"] and run["drafts"] == cold["drafts"]
    model = AutoModelForCausalLM.from_pretrained(eagle3_runs["target"], dtype=torch.float32)
    before_norm: list[torch.Tensor] = []
    model.model.norm.register_forward_hook(lambda module, args, out: before_norm.append(args[0][0]))
    streams = {}
    with torch.no_grad():
        for prompt in prompts():
            hidden = model.model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
            streams[tuple(prompt)] = [hidden[0][0], hidden[1][0], before_norm[-1]]  # entering layers 0, 1, 2
    for layer in tiny_models.EAGLE3_AUX_LAYERS:
        objects = sorted(Path(eagle3_runs["pod-dir"]).rglob(f"*.hidden.L{layer}-{layer + 1}.*"))
        assert len(objects) == sum(n // CHUNK for n in PREFIXES)
        for path in objects:
            trailer, rows = decode_hidden_chunk(path.read_bytes())  # [C, hidden]
            start, end = trailer["token_start"], trailer["token_end"]
            expected = next(s[layer][start:end] for prompt, s in streams.items()
                            if list(prompt[start:end]) == trailer["token_ids"])
            torch.testing.assert_close(rows, expected, atol=1e-4, rtol=1e-4)


def test_chunks_stored_without_an_eagle3_drafts_rows_are_left_to_vllm(eagle3_runs: dict[str, Any]) -> None:
    """The scheduler's lookup asks each chunk for the residual streams at the auxiliary layers vLLM's config
    names (here the draft's `eagle_config`): chunks stored without them are not counted (before, they were,
    and each restore ended at its start, its loads wasted)."""
    check_left_to_vllm(eagle3_runs)
