"""`cacheflow bench vllm-eagle --quick` on real vLLM (CPU) processes: every measured prompt restored with and
without the EAGLE draft, with the next token vLLM computed, and the report written (its numbers are the bench's
business: bench/results/vllm_eagle.md)."""

from __future__ import annotations

import json

import pytest

from cacheflow_bench import vllm, vllm_eagle

pytestmark = pytest.mark.skipif(not vllm.VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")


def test_the_quick_run_restores_every_prompt_with_and_without_the_draft(tmp_path):
    assert vllm_eagle.main(["--quick", "--out", str(tmp_path), "--workdir", str(tmp_path / "work")]) == 0
    body = json.loads((tmp_path / "vllm_eagle.json").read_text())
    assert body["summary"]["every_prompt_restored"] and body["summary"]["next_token_matches"]
    assert body["rows"]["eagle"]["512"]["draft_elapsed"] > 0  # the draft was rerun over the restored prefix
    assert "| 512 |" in (tmp_path / "vllm_eagle.md").read_text()
