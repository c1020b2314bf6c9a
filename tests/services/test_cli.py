"""The `cacheflow` command: profile writes a loadable profile; bad input gets a clear error."""

from __future__ import annotations

import subprocess
import sys

from cacheflow_common.restore.profile import Profile


def _cacheflow(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cacheflow_services.cli", *args], capture_output=True, text=True,
                          timeout=600, check=False)


def test_profile_writes_a_profile(tmp_path):
    out = tmp_path / "profile.json"
    run = _cacheflow("profile", "--model", "tiny", "--chunk-size", "64", "--max-tokens", "256", "--threads", "2",
                     "--store", f"filesystem:{tmp_path / 'chunks'}", "--out", str(out))
    assert run.returncode == 0, run.stderr
    profile = Profile.load(out)
    assert profile.model_name == "tiny" and profile.chunk_size == 64 and len(profile.crossovers) == 3
    assert profile.costs.load.bytes_per_s > 0 and all(c.l_delta > 0 for c in profile.crossovers)


def test_bad_arguments_get_a_clear_error(tmp_path):
    run = _cacheflow("profile", "--model", str(tmp_path / "nowhere"))
    assert run.returncode == 2 and "neither 'tiny', 'qwen3-8b', 'smollm2' nor a directory" in run.stderr
    run = _cacheflow("profile", "--model", "tiny", "--store", "tape:x")
    assert run.returncode == 2 and "unknown store" in run.stderr
