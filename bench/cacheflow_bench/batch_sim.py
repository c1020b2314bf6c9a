"""The batch benchmark's simulator side: the local cluster's model shape, the simulator calibrated to the
cluster from requests restored alone, the simulated runs checked against the measured ones, and the
simulator at cluster scale. `batch.py` drives the real cluster and calls these."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from cacheflow_bench.batch_report import by_batch_and_policy
from cacheflow_common.restore.profile import Profile
from cacheflow_common.sim import ModelShape, SimConfig, simulate
from cacheflow_common.sim.bound_input import trace_bound
from cacheflow_common.sim.config import balanced_link_gbps
from cacheflow_common.sim.replay import ReplayRequest
from cacheflow_common.sim.trace import TraceRequest
from cacheflow_services.coordinator.config import CoordinatorConfig
from cacheflow_services.replay import replay
from cacheflow_services.worker.config import WorkerConfig

MODEL, DTYPE_BYTES, N_STAGES, N_PODS = "tiny", 4, 2, 2
SLOWDOWNS = [1 + i / 20 for i in range(61)]  # compute slowdowns while loading tried in calibration: 1 to 4


def model_shape() -> ModelShape:
    from cacheflow_common.model.sources import model_config

    config = model_config(MODEL)
    return ModelShape(num_layers=config.num_layers,
                      kv_bytes_per_token_layer=2 * config.num_kv_heads * config.head_dim * DTYPE_BYTES)


# -- the simulator ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Calibration:
    """The simulator's cost model fitted to the cluster: factors on the profile's compute costs and load times,
    a fixed time per restore outside the two pointers (the coordinator's and workers' RPCs and setup), and how
    much longer a compute step takes while loads are in flight (loaders and pods share this host's cores)."""

    compute: float = 1.0
    load: float = 1.0
    overhead_s: float = 0.0
    slowdown: float = 1.0


def sim_config(profile: Profile, shape: ModelShape, *, policy: str, batch: int, n_stages: int, n_channels: int,
               link_gbps: float, chunk_size: int, calibration: Calibration = Calibration()) -> SimConfig:
    """The simulated cluster, modelling the workers' engines: batched steps within their token budget,
    compute-only in prefill-sized units; adaptive policies are token-wise on more than one stage, as the
    workers run them (`choose_mode`, which the simulator calls too)."""
    l_delta = profile.l_delta_for(link_gbps * 1e9 / 8)
    return SimConfig(model=shape, costs=profile.costs.scaled(compute=calibration.compute, load=calibration.load),
                     policy=policy, n_stages=n_stages, n_channels=n_channels, link_gbps=link_gbps / calibration.load,
                     chunk_size=chunk_size, l_delta=l_delta, max_batch=batch,
                     batch_window_s=CoordinatorConfig.batch_window_s, restore_overhead_s=calibration.overhead_s,
                     compute_slowdown_while_loading=calibration.slowdown,
                     batched_compute=True, max_batch_tokens=WorkerConfig.step_tokens,
                     beside_forward_tokens=WorkerConfig.beside_forward_tokens,
                     prefill_tokens=WorkerConfig.prefill_tokens)


def calibrate(url: str, token: str, requests: list[ReplayRequest], profile: Profile, shape: ModelShape,
              link_gbps: float, chunk_size: int) -> Calibration:
    """Requests served alone (3 times each, median), the shortest and a median-length one. Compute-only
    (their whole prompt prefilled through the stages) gives the compute factor: the slope of a line
    through both TTFTs. Load-only gives the load factor and the fixed time per restore outside the two
    pointers: the slope and intercept of a line through both restore times. Then the median one restored
    by Cake, computing and loading at once, gives the compute slowdown while loads are in flight: the
    factor at which the simulator, calibrated so far, predicts its restore time."""
    by_length = sorted(requests, key=lambda r: r.trace.input_length)
    short, median = (replace(r, trace=replace(r.trace, arrival_s=0.0))
                     for r in (by_length[0], by_length[len(by_length) // 2]))

    def measured_and_predicted(probe: ReplayRequest, policy: str, key: str) -> tuple[float, float]:
        runs = [replay(url, token, MODEL, [probe], policy)[0] for _ in range(3)]
        config = sim_config(profile, shape, policy=policy, batch=1, n_stages=N_STAGES, n_channels=N_PODS,
                            link_gbps=link_gbps, chunk_size=chunk_size)
        return statistics.median(r[key] for r in runs), simulated(config, [probe], runs[:1], key)[0]

    compute = _slope(*(measured_and_predicted(p, "compute-only", "ttft_s") for p in (short, median)))
    (m_short, p_short), (m_median, p_median) = (measured_and_predicted(p, "load-only", "restore_s")
                                                for p in (short, median))
    load = _slope((m_short, p_short), (m_median, p_median))
    fitted = Calibration(compute=compute, load=load, overhead_s=max(0.0, m_short - load * p_short))
    cake_runs = [replay(url, token, MODEL, [median], "cake")[0] for _ in range(3)]
    cake = statistics.median(r["restore_s"] for r in cake_runs)

    def predicted(slowdown: float) -> float:
        config = sim_config(profile, shape, policy="cake", batch=1, n_stages=N_STAGES, n_channels=N_PODS,
                            link_gbps=link_gbps, chunk_size=chunk_size, calibration=replace(fitted, slowdown=slowdown))
        return simulated(config, [median], cake_runs[:1])[0]

    slowdown = min(SLOWDOWNS, key=lambda f: abs(predicted(f) - cake))
    return replace(fitted, slowdown=slowdown)


def _slope(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Measured over predicted, as the slope of the line through two (measured, predicted) points."""
    (m1, p1), (m2, p2) = sorted((a, b), key=lambda point: point[1])
    return (m2 - m1) / (p2 - p1) if p2 > p1 and m2 > m1 else m2 / p2


def simulated(config: SimConfig, requests: list[ReplayRequest], measured: list[dict[str, Any]],
              key: str = "restore_s") -> list[float]:
    """Per request: the simulated `key` (restore_s or ttft_s), with the prefix the real run found in storage and
    the request entering the admission queue when the real one did (after its prefix lookup)."""
    trace = [replace(r.trace, cached_tokens=m["restored"], arrival_s=r.trace.arrival_s + m["lookup_s"])
             for r, m in zip(requests, measured, strict=True)]
    return [getattr(res, key) for res in simulate(trace, config).requests]


def as_served(trace: list[TraceRequest], policy: str) -> list[TraceRequest]:
    """The trace as the coordinator serves it: a compute-only completion looks nothing up and prefills
    its whole prompt (vLLM on a miss)."""
    return [replace(r, cached_tokens=0) for r in trace] if policy == "compute-only" else trace


def cluster_scale(profile: Profile, shape: ModelShape, requests: list[ReplayRequest], policies: list[str],
                  chunk_size: int) -> list[dict[str, Any]]:
    """8 stages (one layer each: the tiny model has 8), 8 channels, batches 8-64, Tio/Tcomp 2, 1, 0.5."""
    rows = []
    trace = [r.trace for r in requests]
    for ratio in (2.0, 1.0, 0.5):
        link = balanced_link_gbps(profile.costs, shape, n_stages=8, n_channels=8, tokens=1024, ratio=ratio)
        for batch in (8, 16, 32, 64):
            for policy in policies:
                config = sim_config(profile, shape, policy=policy, batch=batch, n_stages=8, n_channels=8,
                                    link_gbps=link, chunk_size=chunk_size)
                summary = simulate(as_served(trace, policy), config).summary()
                rows.append({"tio_over_tcomp": ratio, "link_gbps": link, "batch": batch, "policy": policy,
                             **{k: summary[f"ttft_{k}"] for k in ("mean_s", "p50_s", "p90_s", "p99_s")},
                             **{k: summary[k] for k in ("stage_utilization", "channel_utilization",
                                                        "computed_fraction")}})
    return rows


def sim_errors(profile: Profile, shape: ModelShape, requests: list[ReplayRequest], runs: list[dict[str, Any]],
               link: float, chunk_size: int, calibration: Calibration) -> list[dict[str, Any]]:
    """Per batch size and policy: the (calibrated) simulator's restore time per request against the median
    of its measured runs, and how far one run lands from that median (the machine's own noise)."""
    out = []
    for (batch, policy), mine in by_batch_and_policy(runs).items():
        measured = [_median_request([run["requests"][i] for run in mine]) for i in range(len(requests))]
        config = sim_config(profile, shape, policy=policy, batch=batch, n_stages=N_STAGES, n_channels=N_PODS,
                            link_gbps=link, chunk_size=chunk_size, calibration=calibration)
        predicted = simulated(config, requests, measured)
        timed = [i for i, m in enumerate(measured) if m["restored"] and m["restore_s"] > 0]
        errors = sorted(abs(predicted[i] - measured[i]["restore_s"]) / measured[i]["restore_s"] for i in timed)
        spread = sorted(abs(run["requests"][i]["restore_s"] - measured[i]["restore_s"]) / measured[i]["restore_s"]
                        for run in mine for i in timed)
        sim_mean = sum(predicted) / len(predicted)
        real_mean = sum(m["restore_s"] for m in measured) / len(measured)
        out.append({"batch": batch, "policy": policy, "runs": len(mine), "errors": errors,
                    "max_rel_error": max(errors, default=0.0),
                    "mean_rel_error": abs(sim_mean - real_mean) / real_mean if real_mean else 0.0,
                    "median_rel_error": errors[len(errors) // 2] if errors else 0.0,
                    "run_max_rel_spread": max(spread, default=0.0),
                    "run_median_rel_spread": spread[len(spread) // 2] if spread else 0.0,
                    "mean_restore_real_s": real_mean, "mean_restore_sim_s": sim_mean})
    return out


def _median_request(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One request's measurements over repeated runs: the median restore time and lookup (tokens: the first run's)."""
    return {**samples[0], "restore_s": statistics.median(m["restore_s"] for m in samples),
            "lookup_s": statistics.median(m["lookup_s"] for m in samples)}


def batch_bounds(profile: Profile, shape: ModelShape, requests: list[ReplayRequest], runs: list[dict[str, Any]],
                 link: float, chunk_size: int, calibration: Calibration, slots: int = 40) -> list[dict[str, Any]]:
    """Per batch size: the batch bound (`sched.bound`) of the requests on the calibrated cost model, and each
    policy's mean and slowest-request TTFT (medians over its runs) over it. The bound's grid ends at the
    earliest last first token any run measured."""
    trace = [r.trace for r in requests]
    out = []
    for batch in sorted({run["batch"] for run in runs}):
        mine = [run for run in runs if run["batch"] == batch]
        horizon = min(max(t.arrival_s + q["ttft_s"] for t, q in zip(trace, run["requests"], strict=True))
                      for run in mine)
        config = sim_config(profile, shape, policy="cacheflow", batch=batch, n_stages=N_STAGES, n_channels=N_PODS,
                            link_gbps=link, chunk_size=chunk_size, calibration=calibration)
        bound = trace_bound(trace, config, horizon_s=horizon, slots=slots)
        policies = {}
        for policy in sorted({run["policy"] for run in mine}):
            theirs = [run for run in mine if run["policy"] == policy]
            mean = statistics.median(run["mean_s"] for run in theirs)
            slowest = statistics.median(max(q["ttft_s"] for q in run["requests"]) for run in theirs)
            policies[policy] = {"mean_s": mean, "max_s": slowest, "mean_over_bound": mean / bound.mean_ttft_s,
                                "max_over_bound": slowest / bound.max_ttft_s}
        out.append({"batch": batch, "bound_mean_s": bound.mean_ttft_s, "bound_max_s": bound.max_ttft_s,
                    "policies": policies})
    return out
