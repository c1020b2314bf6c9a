"""The profile file: round trip, validation, L_delta from a crossover table and by the nearest profiled link rate."""

from __future__ import annotations

import json

import pytest

from cacheflow_common.engine.profiler import NEVER_TOKEN_WISE, crossover_length
from cacheflow_common.errors import ConfigError
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.restore.profile import Crossover, Profile

COSTS = CostModel(chunk_compute=LinearCost(fixed_s=1e-3, per_token_s=1e-5, per_token_ctx_s=1e-9),
                  layer_compute=LinearCost(fixed_s=2e-3, per_token_s=1e-5, per_token_ctx_s=1e-9),
                  load=LoadCost(bytes_per_s=5e9, latency_s=1e-4))


def _profile() -> Profile:
    return Profile(model="fp", model_name="tiny", dtype="float32", chunk_size=256, threads=2, costs=COSTS,
                   crossovers=(Crossover(link_bytes_per_s=1e7, l_delta=512),
                               Crossover(link_bytes_per_s=1e9, l_delta=1024)))


def test_round_trip(tmp_path):
    p = _profile()
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p


def test_save_and_load_expand_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    p = _profile()
    p.save("~/profiles/p.json")
    assert (tmp_path / "profiles" / "p.json").is_file()
    assert Profile.load("~/profiles/p.json") == p


def test_l_delta_of_nearest_rate_in_log_scale():
    p = _profile()
    assert p.l_delta_for(2e7) == 512 and p.l_delta_for(5e8) == 1024 and p.l_delta_for(None) == 1024


def test_link_caps_the_load_rate():
    p = _profile()
    assert p.cost_model(1e6).load.bytes_per_s == 1e6 and p.cost_model(1e12).load.bytes_per_s == 5e9


@pytest.mark.parametrize("damage", [{"format": 99}, {"costs": None}, {"crossovers": [{"l_delta": 3}]}])
def test_bad_profiles_are_rejected_with_the_reason(tmp_path, damage):
    body = _profile().to_json()
    body.update(damage)
    (tmp_path / "p.json").write_text(json.dumps(body))
    with pytest.raises(ConfigError, match="profile"):
        Profile.load(tmp_path / "p.json")
    with pytest.raises(ConfigError):
        Profile.load(tmp_path / "absent.json")


def _rows(*winners: str) -> list[dict[str, float]]:
    """A crossover table over lengths 256, 512, ... where each row's winner is `winners[i]`."""
    return [{"n_tokens": 256.0 * (i + 1), "token_s": 1.0 if w == "token" else 2.0,
             "layer_s": 1.0 if w == "layer" else 2.0} for i, w in enumerate(winners)]


def test_crossover_is_where_token_wise_wins_from_on():
    assert crossover_length(_rows("layer", "layer", "token", "token")) == 768
    assert crossover_length(_rows("token", "layer", "token", "token")) == 768  # an early win does not count
    assert crossover_length(_rows("token", "token")) == 256


def test_crossover_never_switches_when_layer_wise_wins_at_the_longest_length():
    assert crossover_length(_rows("token", "layer")) == NEVER_TOKEN_WISE
    assert crossover_length(_rows("layer", "layer")) == NEVER_TOKEN_WISE
