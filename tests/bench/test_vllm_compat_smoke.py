"""A CI-sized slice of the vLLM compatibility matrix on real vLLM (CPU) processes: a Llama that the
connector restores with vLLM's own greedy tokens, and a Gemma 2 (sliding window) that vLLM must serve with
the connector in place, restored or declined, with the same tokens either way; and both under speculative
decoding: with an n-gram draft and Medusa heads (no KV of their own) the connector restores while vLLM drafts
and verifies, and with an EAGLE draft (KV of its own) it restores the draft's KV too (tests/bench/
test_eagle_restore.py checks the draft's counters with a draft that copies its target)."""

from __future__ import annotations

import json

import pytest

from cacheflow_bench import vllm, vllm_compat
from cacheflow_bench.vllm_compat_cell import CHUNK, PREFIXES

pytestmark = pytest.mark.skipif(not vllm.VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")


def test_llama_restores_and_gemma2_serves_with_the_connector_with_and_without_drafts(tmp_path):
    assert vllm_compat.main(["--families", "llama,gemma2", "--tp", "1", "--pp", "1", "--kv-dtypes", "auto",
                             "--lora", "off", "--spec", "ngram,medusa,eagle", "--out", str(tmp_path),
                             "--workdir", str(tmp_path / "work")]) == 0
    body = json.loads((tmp_path / "vllm_compat.json").read_text())
    by_name = {c["name"]: c for c in body["cells"]}
    assert len(by_name) == 6
    llama, gemma2 = by_name["llama-tp1-auto-base"], by_name["gemma2-tp1-auto-base"]
    llama_ngram, gemma2_ngram = by_name["llama-tp1-auto-base-ngram"], by_name["gemma2-tp1-auto-base-ngram"]
    llama_medusa, llama_eagle = by_name["llama-tp1-auto-base-medusa"], by_name["llama-tp1-auto-base-eagle"]
    assert llama["status"] == "ok" and llama["tokens_equal"] and llama["outcome"] == "restored", llama
    assert llama["computed"] + llama["loaded"] == sum(n // CHUNK for n in PREFIXES)  # every whole chunk
    assert llama["computed"] > 0 and llama["loaded"] > 0  # CacheFlow's plan: both pointers moved
    assert gemma2["status"] == "ok" and gemma2["start_ok"] and gemma2["tokens_equal"], gemma2
    assert gemma2["outcome"] in ("restored", "declined")
    assert llama_ngram["status"] == "ok" and llama_ngram["outcome"] == "restored", llama_ngram
    assert llama_ngram["tokens_equal"] and llama_ngram["drafts"] > 0  # vLLM drafted after the restore
    assert gemma2_ngram["status"] == "ok" and gemma2_ngram["tokens_equal"], gemma2_ngram
    assert llama_medusa["outcome"] == "restored" and llama_medusa["tokens_equal"] and llama_medusa["drafts"] > 0
    assert llama_eagle["status"] == "ok" and llama_eagle["tokens_equal"] and llama_eagle["drafts"] > 0, llama_eagle
    assert llama_eagle["outcome"] == "restored" and llama_eagle["computed"] + llama_eagle["loaded"] > 0
    assert body["summary"]["failed_cells"] == 0 and body["summary"]["eagle_outcomes"] == ["restored"]
    assert "| llama | 1 | auto | off | — | ok | yes | yes | restored |" in (tmp_path / "vllm_compat.md").read_text()
