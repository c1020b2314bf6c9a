"""A discrete-event simulator of batch restores, driving the same scheduler objects as the workers.

    requests = read_trace(path, count=200)
    result = simulate(requests, SimConfig(model=ModelShape.of(config), costs=profile.costs, n_stages=8))
    result.summary()  # TTFT mean / P50 / P90 / P99, utilization of stages and channels
"""

from cacheflow_common.sim.config import ModelShape, SimConfig
from cacheflow_common.sim.engine import SimulationStalledError, simulate
from cacheflow_common.sim.result import RequestResult, SimResult, percentile
from cacheflow_common.sim.trace import TraceRequest, parse_trace, read_trace

__all__ = [
    "ModelShape",
    "RequestResult",
    "SimConfig",
    "SimResult",
    "SimulationStalledError",
    "TraceRequest",
    "parse_trace",
    "percentile",
    "read_trace",
    "simulate",
]
