"""The `cacheflow` command: profile writes a loadable profile; bad input and bad cluster specs get a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cacheflow_common.errors import ConfigError
from cacheflow_common.restore.profile import Profile
from cacheflow_services.local_cluster import ClusterSpec


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


def test_a_cluster_spec_pins_each_stage_or_none(tmp_path):
    spec = tmp_path / "cluster.yaml"
    spec.write_text("stages: 2\nstage_cpus: ['0', '1']\n")
    assert ClusterSpec.load(spec).stage_cpus == ["0", "1"]
    spec.write_text("stages: 2\nstage_cpus: ['0']\n")
    with pytest.raises(ConfigError, match="1 CPU sets for 2 stages"):
        ClusterSpec.load(spec)
