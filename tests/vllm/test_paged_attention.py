"""The compute pointer with vLLM's CPU attention kernel over paged blocks (`PagedKV`) restores the same KV and
hidden states as CacheFlow's own attention over its contiguous buffer, fills a loaded unit into the blocks
before a later unit attends over it, and never writes the positions vLLM's own prefix-cache hit holds.
Runs `paged_attention_probe.py` in vLLM's virtual environment (the kernel is vLLM's compiled op)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.vllm.helpers import VLLM_PYTHON, vllm_env

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")
PROBE = Path(__file__).with_name("paged_attention_probe.py")


def test_paged_attention_restores_what_cacheflows_attention_restores(tmp_path):
    out = tmp_path / "probe.json"
    subprocess.run([str(VLLM_PYTHON), "-P", str(PROBE), str(out)], env=vllm_env(), cwd=tmp_path, check=True,
                   timeout=240, capture_output=True)
    result = json.loads(out.read_text())
    assert result["units_compared"] == 4  # every computed unit, including the two after the loaded one
    assert result["max_hidden_diff"] < 1e-4 and result["max_buffer_diff"] < 1e-4
    assert result["blocks_equal_buffer_past_first"]  # computed and loaded positions alike, bit for bit
    assert result["first_positions_untouched"]
