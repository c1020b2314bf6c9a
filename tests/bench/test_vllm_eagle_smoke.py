"""`cacheflow bench vllm-eagle --quick` on real vLLM (CPU) processes, with an EAGLE draft:
every measured prompt restored with and without the draft, with the next token vLLM computed, the draft's KV
loaded with each restored prefix (or, `draft_kv` off, the draft rerun over it), and the report written (its
numbers are the bench's business: bench/results/vllm_eagle.md)."""

from __future__ import annotations

import json

import pytest

from cacheflow_bench import vllm, vllm_eagle

pytestmark = pytest.mark.skipif(not vllm.VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")


def test_the_quick_run_restores_every_prompt_with_and_without_the_draft(tmp_path):
    draft = "eagle"  # the bench's code is the same for a draft model, whose restores test_draft_model_restore.py runs
    argv = ["--quick", "--draft", draft, "--out", str(tmp_path), "--workdir", str(tmp_path / "work")]
    assert vllm_eagle.main(argv) == 0
    body = json.loads((tmp_path / f"vllm_{draft}.json").read_text())
    assert body["draft"] == draft
    assert body["summary"]["every_prompt_restored"] and body["summary"]["next_token_matches"]
    assert body["summary"]["draft_kv_loaded_whole"]  # the draft's stored KV loaded with every restore
    assert body["rows"][f"{draft}-rerun"]["512"]["draft_rerun_tokens"] == 512  # or rerun over it (draft_kv off)
    assert body["rows"][draft]["512"]["draft_elapsed"] > 0
    assert "| 512 |" in (tmp_path / f"vllm_{draft}.md").read_text()
