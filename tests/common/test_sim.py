"""The discrete-event simulator: hand-computed timings, the two-pointer bound, policies side by side,
trace parsing, and a slice of the Mooncake trace for every policy and link rate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cacheflow_common.errors import ConfigError
from cacheflow_common.layer_split import balanced_split
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost, best_split
from cacheflow_common.restore.profile import Crossover, Profile
from cacheflow_common.sched import POLICIES
from cacheflow_common.sim import ModelShape, SimConfig, TraceRequest, parse_trace, percentile, read_trace, simulate
from cacheflow_common.sim.links import SharedLink
from tests.factories import tiny_config

TRACE = Path(__file__).resolve().parents[2] / "bench" / "traces" / "mooncake_conversation_trace.jsonl.gz"
COSTS = CostModel(chunk_compute=LinearCost(fixed_s=1e-3, per_token_s=1e-5, per_token_ctx_s=1e-8),
                  layer_compute=LinearCost(fixed_s=2e-3, per_token_s=1e-5, per_token_ctx_s=1e-8),
                  load=LoadCost(bytes_per_s=1e9, latency_s=1e-4))
MODEL = ModelShape(num_layers=4, kv_bytes_per_token_layer=1000)


def config(policy: str, **options: Any) -> SimConfig:
    return SimConfig(model=MODEL, costs=COSTS, policy=policy, **({"link_gbps": None} | options))


def request(rid: str = "0", cached: int = 1024, suffix: int = 0, arrival: float = 0.0) -> TraceRequest:
    return TraceRequest(request_id=rid, arrival_s=arrival, input_length=cached + suffix, cached_tokens=cached)


def chunk_compute(n_tokens: int, n_layers: int, chunk: int = 256) -> list[float]:
    return [COSTS.chunk_compute_s(a, min(a + chunk, n_tokens), n_layers) for a in range(0, n_tokens, chunk)]


# -- hand-computed timings ----------------------------------------------------------------------------
@pytest.mark.parametrize("n_stages", [1, 2])
def test_compute_only_takes_the_sum_of_its_prefill_unit_costs(n_stages):
    result = simulate([request()], config("compute-only", n_stages=n_stages, prefill_tokens=512))
    r = result.requests[0]  # the engine's compute-only recomputes in prefill-sized units, here 2 of 512
    assert r.restore_s == pytest.approx(sum(chunk_compute(1024, 4 // n_stages, chunk=512)), rel=1e-12)
    assert r.ttft_s == r.restore_s and r.tokens_computed == 1024 and r.tokens_loaded == 0
    assert result.stage_busy_s == pytest.approx([r.restore_s] * n_stages) and result.channel_busy_s == (0.0,)


def test_loads_in_flight_on_one_pod_share_its_link():
    link = SharedLink()
    link.start(0, 2.0, now=0.0)
    link.start(1, 1.0, now=0.0)
    assert link.next_completion(now=0.0) == (2.0, 1)  # two at once: each at half the rate
    link.finish(1, now=2.0)
    assert link.next_completion(now=2.0) == (3.0, 0)  # 1 s of work left, alone again
    link.finish(0, now=3.0)
    assert link.next_completion(now=3.0) is None and link.busy_s == 3.0


def test_per_stage_loaders_share_a_pod_and_take_as_long_as_one_cluster_wide_loader():
    cluster = simulate([request()], config("load-only", n_stages=2, scheduling="cluster")).requests[0]
    per_stage = simulate([request()], config("load-only", n_stages=2, scheduling="per-stage")).requests[0]
    assert per_stage.restore_s == pytest.approx(cluster.restore_s, rel=1e-9)
    assert per_stage.tokens_loaded == cluster.tokens_loaded == 1024


def test_per_stage_scheduling_restores_every_request_for_every_policy():
    trace = [request(str(i), cached=256 * (i + 1), suffix=32, arrival=0.01 * i) for i in range(6)]
    for policy in POLICIES:
        result = simulate(trace, config(policy, n_stages=2, n_channels=2, link_gbps=0.4, scheduling="per-stage"))
        assert all(r.tokens_computed + r.tokens_loaded == pytest.approx(r.cached_tokens) for r in result.requests)


def test_load_only_takes_the_sum_of_its_loads_on_one_channel():
    r = simulate([request()], config("load-only")).requests[0]
    assert r.restore_s == pytest.approx(4 * COSTS.chunk_load_s(256 * 4 * 1000), rel=1e-12)
    assert r.tokens_loaded == 1024 and r.tokens_computed == 0


def test_two_channels_halve_a_load_only_restore():
    one = simulate([request()], config("load-only", n_channels=1)).requests[0].restore_s
    two = simulate([request()], config("load-only", n_channels=2)).requests[0]
    assert two.restore_s == pytest.approx(one / 2, rel=1e-12)


def test_link_rate_limits_loads():
    r = simulate([request()], config("load-only", link_gbps=4.0)).requests[0]  # 0.5 GB/s, below the store's 1 GB/s
    assert r.restore_s == pytest.approx(4 * (1e-4 + 256 * 4 * 1000 / 0.5e9), rel=1e-12)


@pytest.mark.parametrize("n_stages", [1, 2])
def test_the_suffix_prefill_follows_the_restore_through_every_stage(n_stages):
    r = simulate([request(suffix=100)], config("compute-only", n_stages=n_stages)).requests[0]
    prefill = n_stages * COSTS.chunk_compute_s(1024, 1124, 4 // n_stages)
    assert r.ttft_s == pytest.approx(r.restore_s + prefill, rel=1e-12)


def test_a_full_batch_makes_later_requests_queue_in_arrival_order():
    result = simulate([request("0"), request("1")], config("compute-only", max_batch=1))
    first, second = result.requests
    assert first.queue_s == 0 and second.queue_s == pytest.approx(first.restore_s)


def test_a_request_holds_its_slot_until_its_first_token():
    result = simulate([request("0", suffix=100), request("1")], config("compute-only", max_batch=1))
    first, second = result.requests
    assert first.ttft_s > first.restore_s and second.queue_s == pytest.approx(first.ttft_s)


def test_the_restore_overhead_delays_the_suffix_but_not_a_request_with_nothing_cached():
    plain, slow = (simulate([request("0", suffix=100), request("1", cached=0, suffix=100, arrival=5.0)],
                            config("compute-only", restore_overhead_s=overhead)).requests for overhead in (0.0, 0.25))
    assert slow[0].restore_s == pytest.approx(plain[0].restore_s + 0.25)
    assert slow[0].ttft_s == pytest.approx(plain[0].ttft_s + 0.25)
    assert slow[1].ttft_s == pytest.approx(plain[1].ttft_s) and slow[1].restore_s == 0


@pytest.mark.parametrize("arrivals, admitted", [((0.0,), (0.5,)), ((0.0, 0.2), (0.2, 0.2)), ((0.0, 0.6), (0.5, 1.1))])
def test_a_batch_forms_when_its_window_closes_or_it_is_full(arrivals, admitted):
    trace = [request(str(i), cached=256, arrival=t) for i, t in enumerate(arrivals)]
    result = simulate(trace, config("compute-only", max_batch=2, batch_window_s=0.5))
    assert [r.arrival_s + r.queue_s for r in result.requests] == pytest.approx(admitted)


def test_one_batch_pays_the_fixed_cost_once():
    two = simulate([request("0", cached=256), request("1", cached=256)], config("compute-only"))
    alone = chunk_compute(256, 4)[0]
    assert two.requests[0].restore_s == pytest.approx(2 * alone - 4 * COSTS.chunk_compute.fixed_s)
    unbatched = simulate([request("0", cached=256), request("1", cached=256)],
                         config("compute-only", batched_compute=False))
    assert unbatched.requests[0].restore_s == pytest.approx(2 * alone)


def test_steps_that_start_while_loads_are_in_flight_take_the_slowdown_longer():
    trace = [request("0", cached=2048)]
    balanced = {"link_gbps": 0.2, "chunk_size": 256}  # compute and loads both take part in a cake restore
    plain, slowed = (simulate(trace, config(policy, compute_slowdown_while_loading=factor, **balanced)).requests[0]
                     for policy, factor in (("cake", 1.0), ("cake", 2.0)))
    assert slowed.restore_s > plain.restore_s and slowed.tokens_computed < plain.tokens_computed
    alone, alone_slowed = (simulate(trace, config("compute-only", compute_slowdown_while_loading=f)).requests[0]
                           for f in (1.0, 2.0))
    assert alone_slowed.restore_s == alone.restore_s  # nothing loads: no step is slowed


# -- the bound and the policies side by side -----------------------------------------------------------
def test_one_request_never_beats_the_two_pointer_bound():
    compute = chunk_compute(4096, 4)
    load = [COSTS.chunk_load_s(256 * 4 * 1000)] * len(compute)
    _, bound = best_split(compute, load)
    r = simulate([request(cached=4096)], config("cacheflow")).requests[0]
    assert bound - 1e-12 <= r.restore_s <= bound + max(max(compute), max(load))
    assert 0 < r.tokens_loaded < 4096 and r.tokens_computed + r.tokens_loaded == pytest.approx(4096)


def test_cacheflow_matches_or_beats_compute_only_and_load_only_on_a_balanced_batch():
    # At 0.4 Gbit/s a chunk (256 tokens x 2 layers x 1000 B) loads in ~10 ms, about what computing it costs.
    lengths = [512, 4096, 1024, 8192, 2048]
    trace = [request(str(i), cached=n, suffix=64, arrival=0.001 * i) for i, n in enumerate(lengths)]
    results = {p: simulate(trace, config(p, n_stages=2, n_channels=2, link_gbps=0.4)) for p in POLICIES}
    summaries = {p: r.summary() for p, r in results.items()}
    for baseline in ("compute-only", "load-only"):
        assert summaries["cacheflow"]["ttft_mean_s"] <= summaries[baseline]["ttft_mean_s"]
        assert summaries["cacheflow"]["makespan_s"] <= summaries[baseline]["makespan_s"]
    assert 0 < summaries["cacheflow"]["computed_fraction"] < 1


def test_only_cacheflow_goes_layer_wise_below_l_delta():
    short = [request(cached=300)]
    assert simulate(short, config("cacheflow", l_delta=512)).requests[0].mode == "layer"
    assert simulate(short, config("cake", l_delta=512)).requests[0].mode == "token"
    assert simulate(short, config("cacheflow", l_delta=256)).requests[0].mode == "token"


def test_simulations_are_deterministic():
    trace = [request(str(i), cached=1024 * (i + 1), suffix=300, arrival=0.01 * i) for i in range(6)]
    cfg = config("cacheflow", n_stages=2, n_channels=3, placement="hash")
    assert simulate(trace, cfg) == simulate(trace, cfg)


# -- configuration ------------------------------------------------------------------------------------
def test_model_shape_from_a_model_config():
    cfg = tiny_config()
    shape = ModelShape.of(cfg)
    assert shape.num_layers == cfg.num_layers
    assert shape.kv_bytes_per_token_layer == 2 * cfg.num_kv_heads * cfg.head_dim * 4  # float32


def test_config_from_a_profile_takes_its_costs_and_the_nearest_l_delta():
    profile = Profile(model="fp", model_name="tiny", dtype="float32", chunk_size=256, threads=2, costs=COSTS,
                      crossovers=(Crossover(link_bytes_per_s=1.25e9, l_delta=512),
                                  Crossover(link_bytes_per_s=1e10, l_delta=2048)))
    cfg = SimConfig.from_profile(profile, model=MODEL, link_gbps=80.0, n_stages=2)
    assert cfg.costs == COSTS and cfg.l_delta == 2048 and cfg.n_stages == 2
    assert cfg.link_costs().load.bytes_per_s == 1e9  # the store (1 GB/s) is slower than the 80 Gbit/s link


@pytest.mark.parametrize("bad", [{"policy": "fastest"}, {"placement": "random"}, {"n_stages": 5},
                                 {"n_channels": 0}, {"batch_window_s": -1}, {"restore_overhead_s": -1},
                                 {"compute_slowdown_while_loading": 0.5},
                                 {"stage_layers": (1, 2)},
                                 {"n_stages": 2, "stage_layers": (4, 0)}])
def test_bad_configs_are_refused(bad):
    options = {"policy": "cacheflow"} | bad
    with pytest.raises(ConfigError):
        config(**options)


def test_default_split_is_the_stage_workers_split():
    split = SimConfig(model=ModelShape(num_layers=10, kv_bytes_per_token_layer=1), costs=COSTS,
                      n_stages=4).layer_split()
    assert split == tuple(len(r) for r in balanced_split(10, 4))
    assert sum(split) == 10 and max(split) - min(split) == 1


# -- traces -------------------------------------------------------------------------------------------
LINES = [
    '{"timestamp": 0, "input_length": 1200, "output_length": 5, "hash_ids": [1, 2, 3]}',
    '{"timestamp": 1000, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 9]}',
    '{"timestamp": 3000, "input_length": 700, "output_length": 5, "hash_ids": [1, 2]}',
    '{"timestamp": 4000, "input_length": 900, "output_length": 5, "hash_ids": [7, 1]}',
]


def test_cached_prefix_is_the_leading_run_of_seen_blocks():
    reqs = parse_trace(LINES)
    assert [r.cached_tokens for r in reqs] == [0, 1024, 700, 0]  # capped at the input; a gap ends the run
    assert [r.arrival_s for r in reqs] == [0.0, 1.0, 3.0, 4.0]


def test_a_slice_keeps_the_cache_its_earlier_requests_left_and_rebases_time():
    reqs = parse_trace(LINES, start=1, count=2, time_scale=0.5)
    assert [r.request_id for r in reqs] == ["1", "2"]
    assert [r.cached_tokens for r in reqs] == [1024, 700] and [r.arrival_s for r in reqs] == [0.0, 1.0]


def test_malformed_trace_lines_are_refused_with_the_line_number():
    with pytest.raises(ConfigError, match="line 2"):
        parse_trace([LINES[0], '{"timestamp": 1}'])
    with pytest.raises(ConfigError):
        read_trace("/nonexistent/trace.jsonl")


def test_inconsistent_requests_are_refused():
    with pytest.raises(ConfigError, match="cached prefix"):
        request(cached=100, suffix=-50)
    with pytest.raises(ConfigError, match="twice"):
        simulate([request("a"), request("a")], config("cacheflow"))


def test_percentile_interpolates_between_ranks():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0 and percentile([], 50) == 0.0


@pytest.mark.skipif(not TRACE.exists(), reason=f"the Mooncake trace {TRACE} is missing")
@pytest.mark.parametrize("gbps", [10, 40, 80])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_trace_slice_runs_for_every_policy(policy, gbps):
    llama_8b = ModelShape(num_layers=32, kv_bytes_per_token_layer=2 * 8 * 128 * 2)
    costs = CostModel(chunk_compute=LinearCost(fixed_s=5e-5, per_token_s=1.2e-6, per_token_ctx_s=4e-11),
                      layer_compute=LinearCost(fixed_s=5e-5, per_token_s=1.2e-6, per_token_ctx_s=4e-11),
                      load=LoadCost(bytes_per_s=25e9, latency_s=2e-4))
    trace = read_trace(TRACE, start=2000, count=40, time_scale=0.1)
    result = simulate(trace, SimConfig(model=llama_8b, costs=costs, policy=policy, n_stages=8, n_channels=4,
                                       link_gbps=gbps, max_batch=64, l_delta=1024))
    summary = result.summary()
    assert summary["requests"] == 40
    assert 0 < summary["ttft_p50_s"] <= summary["ttft_p90_s"] <= summary["ttft_p99_s"]
    for r in result.requests:
        assert r.ttft_s >= r.queue_s + r.restore_s - 1e-9
        assert r.tokens_computed + r.tokens_loaded == pytest.approx(r.cached_tokens)  # no misses: once each
    assert all(0 <= u <= 1 + 1e-9 for u in result.stage_utilization() + result.channel_utilization())
    if policy == "compute-only":
        assert summary["computed_fraction"] == 1.0
    if policy == "load-only":
        assert summary["computed_fraction"] == 0.0
