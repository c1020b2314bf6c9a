"""The batch bound (`sched.bound`) of a simulated trace: the same unit costs the simulator runs with.

Each request is planned token-wise as the simulator plans it (chunks of `chunk_size`, on the channels
its placement gives in admission order); what follows its restore is the restore overhead and its
suffix prefill through the stages alone, in the simulator's slices: the last stage runs every slice
after the first crossed the others, and the first stage runs every slice before the last crosses the
rest (`tail_s` is the larger); each stage's capacity takes the slices' cost less their fixed part.
"""

from __future__ import annotations

from collections.abc import Sequence

from cacheflow_common.sched.bound import DEFAULT_SLOTS, BatchBound, BoundRequest, batch_bound
from cacheflow_common.sched.plan import build_plan, chunk_costs
from cacheflow_common.sim.config import SimConfig
from cacheflow_common.sim.engine import placement
from cacheflow_common.sim.trace import TraceRequest


def bound_requests(trace: Sequence[TraceRequest], config: SimConfig) -> list[BoundRequest]:
    costs, layers = config.link_costs(), config.layer_split()
    ordered = sorted(enumerate(trace), key=lambda item: (item[1].arrival_s, item[0]))
    out = []
    for order, (_, r) in enumerate(ordered):
        plan = build_plan(request_id=r.request_id, arrival_s=r.arrival_s, n_tokens=r.cached_tokens, costs=costs,
                          stage_layers=layers, chunk_size=config.chunk_size, mode="token",
                          kv_bytes_per_token_layer=config.model.kv_bytes_per_token_layer,
                          place=placement(config, r.request_id, order))
        size = config.prefill_tokens
        slices = [(a, min(a + size, r.input_length)) for a in range(r.cached_tokens, r.input_length, size)]
        cost = [[chunk_costs(costs, a, b, n) for n in layers] for a, b in slices]  # [slice][stage] (s, fixed)
        tail = 0.0
        if slices:
            last_stage = sum(c[-1][0] for c in cost) + sum(c[0] for c in cost[0][:-1])
            first_stage = sum(c[0][0] for c in cost) + sum(c[0] for c in cost[-1][1:])
            tail = max(last_stage, first_stage)
        overhead = config.restore_overhead_s if r.cached_tokens else 0.0
        prefill = tuple(sum(c[s][0] - c[s][1] for c in cost) for s in range(len(layers)))
        out.append(BoundRequest(plan=plan, tail_s=overhead + tail, prefill_s=prefill))
    return out


def trace_bound(trace: Sequence[TraceRequest], config: SimConfig, *, horizon_s: float | None = None,
                slots: int = DEFAULT_SLOTS) -> BatchBound:
    """No schedule of `trace` on the cluster `config` describes has a lower mean (or slowest) TTFT.

    `horizon_s`: a good schedule's last first token (absolute), where the bound's grid ends (tighter)."""
    return batch_bound(bound_requests(trace, config), horizon_s=horizon_s, slots=slots, max_batch=config.max_batch)
