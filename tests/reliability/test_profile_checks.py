"""Profiles that cannot mislead: a profile names the model, dtype and device it measured and is refused
for any other; costs that fall as length grows are refused on load; measured series that fall as length
grows are timed again (a bounded number of rounds) and the profile records it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

import pytest
import torch

from cacheflow_common.auth import INTERNAL_TOKEN_FILE, VERIFY_KEY_FILE, ensure_cluster_secrets
from cacheflow_common.engine import profiler
from cacheflow_common.engine.profiler import falling_points, settle_monotone
from cacheflow_common.errors import ConfigError
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.restore.measured import measured_as
from cacheflow_common.restore.profile import Crossover, MonotoneCheck, Profile
from tests.factories import tiny_model

COSTS = CostModel(chunk_compute=LinearCost(fixed_s=1e-3, per_token_s=1e-5, per_token_ctx_s=1e-9),
                  layer_compute=LinearCost(fixed_s=2e-3, per_token_s=1e-5, per_token_ctx_s=1e-9),
                  load=LoadCost(bytes_per_s=5e9, latency_s=1e-4))


def _profile_of(model_fp: str, dtype: str = "float32", device: str = "cpu") -> Profile:
    return Profile(model=model_fp, model_name="tiny", dtype=dtype, device=device, chunk_size=16, threads=1,
                   costs=COSTS, crossovers=(Crossover(link_bytes_per_s=1e9, l_delta=64),),
                   checks=(MonotoneCheck(what="layer compute vs length", remeasured=2, monotone=True),))


def test_a_profile_round_trips_what_it_was_measured_for(tmp_path):
    model = tiny_model(seed=1)
    profile = Profile(**measured_as(model), model_name="tiny", chunk_size=16, threads=1, costs=COSTS,
                      crossovers=(Crossover(link_bytes_per_s=1e9, l_delta=64),))
    assert (profile.model, profile.dtype, profile.device) == (model.fingerprint(), "float32", "cpu")
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json", model=model) == profile


@pytest.mark.parametrize(("other", "named"), [
    (lambda m: _profile_of("0" * 32), "model 00000000000000000000000000000000 (this model: {fp})"),
    (lambda m: _profile_of(m.fingerprint(), dtype="bfloat16"), "dtype bfloat16 (this model: float32)"),
    (lambda m: _profile_of(m.fingerprint(), device="cuda (NVIDIA H100 80GB HBM3)"),
     "device cuda (NVIDIA H100 80GB HBM3) (this model: cpu)"),
])
def test_a_profile_of_another_model_dtype_or_device_is_refused_naming_both(tmp_path, other, named):
    model = tiny_model(seed=1)
    other(model).save(tmp_path / "p.json")
    with pytest.raises(ConfigError) as refused:
        Profile.load(tmp_path / "p.json", model=model)
    assert named.format(fp=model.fingerprint()) in str(refused.value) and "p.json" in str(refused.value)
    assert Profile.load(tmp_path / "p.json").model_name == "tiny"  # without a model to check against: read as is


def test_a_worker_refuses_a_profile_of_another_model(tmp_path):
    """`cacheflow worker` with a profile measured for other weights exits before it serves, naming both."""
    import subprocess
    import sys

    _profile_of("f" * 32).save(tmp_path / "p.json")
    secrets = ensure_cluster_secrets(tmp_path / "internal")
    run = subprocess.run([sys.executable, "-m", "cacheflow_services.cli", "worker", "--stage", "0", "--layers", "0:8",
                          "--model", "tiny", "--dtype", "float32", "--pods", "pod-0=127.0.0.1:1",
                          "--internal-token-file", str(secrets / INTERNAL_TOKEN_FILE),
                          "--grant-key-file", str(secrets / VERIFY_KEY_FILE), "--profile", str(tmp_path / "p.json")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert f"model {'f' * 32} (this model: " in run.stderr and '"event": "ready"' not in run.stdout


@pytest.mark.parametrize("cost", ["chunk_compute", "layer_compute"])
def test_costs_that_fall_as_length_grows_are_refused_on_load(tmp_path, cost):
    body = _profile_of("fp").to_json()
    body["costs"][cost]["per_token_s"] = -1e-5
    (tmp_path / "p.json").write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=f"{cost} cost .* falls as length grows"):
        Profile.load(tmp_path / "p.json")


def _replay(values: list[float]) -> tuple[list[int], Callable[[int], float]]:
    """A re-measurement that answers `values` in turn, recording which points it was asked for."""
    asked: list[int] = []
    queue: Iterator[float] = iter(values)

    def remeasure(i: int) -> float:
        asked.append(i)
        return next(queue)

    return asked, remeasure


def test_a_falling_series_is_timed_again_until_it_no_longer_falls(caplog):
    # Lengths grow left to right; point 1 was slowed by another process (5.0 s, yet 3 s at a longer length).
    first = [1.0, 5.0, 3.0, 4.0]
    assert falling_points(first) == [1, 2, 3]
    asked, remeasure = _replay([2.0, 3.1, 4.2])
    with caplog.at_level(logging.WARNING, logger=profiler.__name__):
        settled, check = settle_monotone("layer compute vs length", first, remeasure)
    assert asked == [1, 2, 3] and settled == [1.0, 2.0, 3.0, 4.0]  # the faster of two timings is kept
    assert check == MonotoneCheck(what="layer compute vs length", remeasured=3, monotone=True)
    assert "layer compute vs length falls as length grows" in caplog.text


def test_a_series_that_keeps_falling_is_timed_again_a_bounded_number_of_times_and_recorded(caplog):
    asked, remeasure = _replay([9.0] * 100)  # every re-measurement is as slow: it never gets better
    with caplog.at_level(logging.WARNING, logger=profiler.__name__):
        settled, check = settle_monotone("cacheflow-layer restore vs length", [3.0, 1.0], remeasure, rounds=2)
    assert settled == [3.0, 1.0] and asked == [0, 1, 0, 1]
    assert check == MonotoneCheck(what="cacheflow-layer restore vs length", remeasured=4, monotone=False)
    assert "still falls as length grows after 2 rounds" in caplog.text
    assert falling_points([1.0, 0.95, 1.2]) == []  # within the noise allowed


def test_the_profiler_records_its_checks_in_the_profile():
    """A profile measured here carries one check per measured series (no assertion on the times)."""
    from cacheflow_common.store.memory import MemoryStore

    model = tiny_model(seed=2, num_layers=2)
    settings = profiler.ProfileSettings.quick(chunk_size=16, max_tokens=64)
    profile = profiler.profile_model(model, store=MemoryStore(), settings=settings, model_name="tiny")
    whats = [c.what for c in profile.checks]
    assert "layer compute vs length" in whats and "chunk compute of 16 tokens vs position" in whats
    assert {"cacheflow-token restore vs length at Tio/Tcomp=1.0",
            "cacheflow-layer restore vs length at Tio/Tcomp=1.0"} <= set(whats)
    assert Profile.from_json(json.loads(json.dumps(profile.to_json()))) == profile
    profile.check_fits(model)
    with pytest.raises(ConfigError, match="dtype float32 \\(this model: bfloat16\\)"):
        profile.check_fits(tiny_model(seed=2, num_layers=2, dtype=torch.bfloat16))
