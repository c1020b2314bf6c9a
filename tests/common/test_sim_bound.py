"""The batch bound of a simulated trace: no policy the simulator runs beats it, on the mean or the slowest
request; a lone request with no suffix is bounded by its two-pointer optimum."""

from __future__ import annotations

import random

import pytest

from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.sim import ModelShape, SimConfig, TraceRequest, simulate
from cacheflow_common.sim.bound_input import bound_requests, trace_bound

COSTS = CostModel(chunk_compute=LinearCost(fixed_s=1e-3, per_token_s=1e-5, per_token_ctx_s=1e-8),
                  layer_compute=LinearCost(fixed_s=2e-3, per_token_s=1e-5, per_token_ctx_s=1e-8),
                  load=LoadCost(bytes_per_s=1e9, latency_s=1e-4))
SHAPE = ModelShape(num_layers=4, kv_bytes_per_token_layer=4096)


def config(policy: str, max_batch: int = 4) -> SimConfig:
    return SimConfig(model=SHAPE, costs=COSTS, policy=policy, n_stages=2, n_channels=2, link_gbps=0.5,
                     chunk_size=256, max_batch=max_batch, prefill_tokens=512, restore_overhead_s=1e-3)


def random_trace(seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(6):
        t += rng.uniform(0, 0.05)
        cached = rng.choice((0, 256, 512, 1024, 2048))
        out.append(TraceRequest(request_id=str(i), arrival_s=t, cached_tokens=cached,
                                input_length=cached + rng.choice((0, 64, 700))))
    return out


@pytest.mark.parametrize("max_batch", [1, 2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_no_simulated_policy_beats_the_bound(seed: int, max_batch: int) -> None:
    trace = random_trace(seed)
    results = {p: simulate(trace, config(p, max_batch)) for p in ("cake", "cacheflow", "load-only")}
    horizon = min(max(r.arrival_s + r.ttft_s for r in res.requests) for res in results.values())
    bound = trace_bound(trace, config("cacheflow", max_batch), horizon_s=horizon, slots=16)
    for res in results.values():
        summary = res.summary()
        assert bound.mean_ttft_s <= summary["ttft_mean_s"] + 1e-9
        assert bound.max_ttft_s <= max(r.ttft_s for r in res.requests) + 1e-9
    assert 0 < bound.mean_ttft_s <= bound.max_ttft_s


def test_the_tail_is_the_suffix_through_every_stage() -> None:
    trace = [TraceRequest(request_id="0", arrival_s=0.0, cached_tokens=0, input_length=300)]
    (request,) = bound_requests(trace, config("cacheflow"))
    alone = simulate(trace, config("cacheflow")).requests[0].ttft_s
    assert request.tail_s == pytest.approx(alone)  # one slice, nothing to restore: the bound is exact
    assert trace_bound(trace, config("cacheflow")).mean_ttft_s == pytest.approx(alone, rel=1e-5)
