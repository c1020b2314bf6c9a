"""`cacheflow profile`: measure this machine's compute and load costs and the L_delta crossover.

It sits above the engine (`restore()` times both modes for real); the profile it writes is
`restore/profile.py`'s, read by everything below.

1. Per-chunk compute cost vs position (and a few chunk sizes), fitted per layer.
2. Per-layer cost of a layer-wise pass over N tokens, fitted per layer.
3. Raw store read throughput and the fixed cost of a read.
4. For a few link rates, both restore modes run for real over a grid of prefix lengths; L_delta is the
   shortest length from which token-wise is never slower than layer-wise (the paper's Fig. 3).
Layers of a model are alike, so steps 1–2 time a few of them and divide; step 4 uses all of them.

A time must not fall as length grows (on a busy machine a short point can take longer than a long one,
and the fits and L_delta then say nonsense): where a series does, the profiler warns and times the
points at fault again, a bounded number of rounds, and the profile records it (`Profile.checks`).
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from cacheflow_common.engine import restore
from cacheflow_common.kv.chunk import encode_kv_chunk
from cacheflow_common.kv.keys import ChunkKey
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.restore.costs import CostModel, LinearCost, LoadCost
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.measured import measured_as
from cacheflow_common.restore.profile import Crossover, MonotoneCheck, Profile
from cacheflow_common.restore.save import dtype_name, make_job, save_prefix
from cacheflow_common.store.base import ChunkStore
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.shaped import ShapedStore
from cacheflow_common.transport.shaping import TokenBucket

log = logging.getLogger(__name__)
Progress = Callable[[str], None]
NEVER_TOKEN_WISE = 2**31 - 1  # L_delta when layer-wise still wins at the longest profiled length
MONOTONE_SLACK = 0.1  # a longer point may time this much below a shorter one (noise), no more
MONOTONE_ROUNDS = 3  # rounds of re-measuring the points of a series that falls as length grows


@dataclass(frozen=True, kw_only=True)
class ProfileSettings:
    chunk_size: int = 256  # the restore's default chunk size (docs/architecture.md, "Chunk keys")
    max_tokens: int = 4096  # longest prefix timed for the compute fits
    sample_layers: int = 4  # layers timed for the per-layer fits (layers are alike)
    repeats: int = 3  # best of N: the minimum is the least noisy estimate on a shared machine
    crossover_ratios: tuple[float, ...] = (0.5, 1.0, 2.0)  # Tio/Tcomp at the grid's middle length
    crossover_chunks: tuple[float, ...] = (0.5, 1, 2, 3, 4, 6, 8)  # prefix lengths, in chunks

    @classmethod
    def quick(cls, chunk_size: int, max_tokens: int) -> ProfileSettings:
        """A profile in a fraction of the time: one timing per point, one link ratio, fewer lengths."""
        return cls(chunk_size=chunk_size, max_tokens=max_tokens, sample_layers=2, repeats=1,
                   crossover_ratios=(1.0,), crossover_chunks=(1, 2, 4))


def profile_model(model: Transformer, *, store: ChunkStore, settings: ProfileSettings,
                  model_name: str, progress: Progress | None = None) -> Profile:
    """Measure `model` on this machine, reading through `store` (unshaped), and build a profile."""
    say = progress or (lambda _msg: None)
    checks: list[MonotoneCheck] = []
    say("chunk compute cost vs position")
    chunk_cost = _fit_chunk_compute(model, settings, checks)
    say("layer compute cost vs length")
    layer_cost = _fit_layer_compute(model, settings, checks)
    say("store read throughput")
    load = _measure_load(model, store, settings)
    costs = CostModel(chunk_compute=chunk_cost, layer_compute=layer_cost, load=load)
    crossovers = []
    prefixes = _crossover_prefixes(model, settings)
    for ratio in settings.crossover_ratios:
        say(f"L_delta crossover at Tio/Tcomp={ratio}")
        crossovers.append(_measure_crossover(model, costs, settings, ratio, prefixes, checks))
    return Profile(**measured_as(model), model_name=model_name, chunk_size=settings.chunk_size,
                   threads=torch.get_num_threads(), costs=costs, crossovers=tuple(crossovers), machine=_machine(),
                   checks=tuple(checks))


def falling_points(times: Sequence[float], slack: float = MONOTONE_SLACK) -> list[int]:
    """Points of a series ordered by growing length in a pair where the longer one is faster than the
    shorter by more than `slack` (relative): both points of every such pair."""
    bad: set[int] = set()
    for j, later in enumerate(times):
        bad.update(k for i in range(j) if later < times[i] * (1 - slack) for k in (i, j))
    return sorted(bad)


def settle_monotone(what: str, times: Sequence[float], remeasure: Callable[[int], float], *,
                    rounds: int = MONOTONE_ROUNDS) -> tuple[list[float], MonotoneCheck]:
    """`times` with the points of falling pairs timed again (keeping the faster: noise only slows), at most
    `rounds` times; and the check, for the profile."""
    settled, remeasured = list(times), 0
    for _ in range(rounds):
        bad = falling_points(settled)
        if not bad:
            break
        log.warning("profile: %s falls as length grows (points %s: %s s); timing them again", what, bad,
                    ", ".join(f"{settled[i]:.3g}" for i in bad))
        for i in bad:
            settled[i] = min(settled[i], remeasure(i))
        remeasured += len(bad)
    monotone = not falling_points(settled)
    if not monotone:
        log.warning("profile: %s still falls as length grows after %d rounds of timing again (%s s); "
                    "the profile records it: profile again on a quieter machine", what, rounds,
                    ", ".join(f"{t:.3g}" for t in settled))
    return settled, MonotoneCheck(what=what, remeasured=remeasured, monotone=monotone)


def _machine() -> dict[str, str | int]:
    return {"node": platform.node(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count() or 0, "torch": torch.__version__}


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _fit(rows: Sequence[tuple[float, float, float]], times: Sequence[float]) -> LinearCost:
    """Least-squares `fixed + a * x1 + b * x2`, coefficients clipped at zero (costs are not negative)."""
    a = np.array(rows, dtype=np.float64)  # [M, 3]
    coef, *_ = np.linalg.lstsq(a, np.array(times), rcond=None)
    coef = np.clip(coef, 0.0, None)
    return LinearCost(fixed_s=float(coef[0]), per_token_s=float(coef[1]), per_token_ctx_s=float(coef[2]))


def _sample_layers(model: Transformer, settings: ProfileSettings) -> range:
    return range(model.layers.start, model.layers.start + min(settings.sample_layers, len(model.layers)))


def _fit_chunk_compute(model: Transformer, settings: ProfileSettings, checks: list[MonotoneCheck]) -> LinearCost:
    layers = _sample_layers(model, settings)
    c, n_max = settings.chunk_size, settings.max_tokens
    kv = model.new_kv(layers, n_max)
    ids = torch.randint(0, model.config.vocab_size, (n_max,))  # [N]
    spans = [(p, min(c, n_max - p)) for p in range(0, n_max, c)]
    spans += [(p, t) for p in (0, n_max // 2) for t in (max(1, c // 4), max(1, c // 2))]

    def time_span(i: int) -> float:  # again later: its context is in the buffer by then
        p, t = spans[i]
        hidden = model.embed(ids[p : p + t])  # [T, hidden]
        return _best_time(partial(model.forward_layers, hidden, layers, [Span(kv, p, t)]), settings.repeats)

    def time_in(group: list[int]) -> Callable[[int], float]:
        return lambda k: time_span(group[k])

    times = [time_span(i) for i in range(len(spans))]  # in order: every chunk's context is in the buffer first
    for t in sorted({t for _, t in spans}):  # per chunk size, the time must not fall as the position grows
        group = sorted((i for i, span in enumerate(spans) if span[1] == t), key=lambda i: spans[i][0])
        if len(group) < 2:
            continue
        settled, check = settle_monotone(f"chunk compute of {t} tokens vs position", [times[i] for i in group],
                                         time_in(group))
        for i, sec in zip(group, settled, strict=True):
            times[i] = sec
        checks.append(check)
    rows = [(1.0, float(t), t * (p + t / 2)) for p, t in spans]
    return _fit(rows, [sec / len(layers) for sec in times])


def _fit_layer_compute(model: Transformer, settings: ProfileSettings, checks: list[MonotoneCheck]) -> LinearCost:
    layers = _sample_layers(model, settings)
    c, n_max = settings.chunk_size, settings.max_tokens
    kv = model.new_kv(layers, n_max)
    lengths = sorted({max(1, c // 2), c, 2 * c, 4 * c, n_max // 2, n_max} & set(range(1, n_max + 1)))

    def time_length(i: int) -> float:
        hidden = model.embed(torch.randint(0, model.config.vocab_size, (lengths[i],)))  # [N, hidden]
        return _best_time(partial(model.forward_layers, hidden, layers, [Span(kv, 0, lengths[i])]), settings.repeats)

    times, check = settle_monotone("layer compute vs length", [time_length(i) for i in range(len(lengths))],
                                   time_length)
    checks.append(check)
    rows = [(1.0, float(n), n * n / 2) for n in lengths]
    return _fit(rows, [sec / len(layers) for sec in times])


def _measure_load(model: Transformer, store: ChunkStore, settings: ProfileSettings) -> LoadCost:
    cfg, t = model.config, settings.chunk_size
    kv = torch.zeros(len(model.layers), 2, cfg.num_kv_heads, t, cfg.head_dim, dtype=model.dtype)
    key = ChunkKey(digest=os.urandom(16), index=0, token_start=0, token_end=t)
    obj = encode_kv_chunk(key=key, token_ids=[0] * t, model=model.fingerprint(), layer_start=model.layers.start,
                          kv=kv, dtype=dtype_name(model.dtype))
    name = f"profile-{key.hex}"
    store.put(name, obj)
    try:
        big, small = memoryview(bytearray(len(obj))), memoryview(bytearray(64))
        whole = _best_time(lambda: store.read_into(name, big, 0), settings.repeats + 2)
        tiny = _best_time(lambda: store.read_into(name, small, 0), settings.repeats + 2)
    finally:
        store.delete(name)
    latency = max(tiny, 1e-7)
    rate = len(obj) / max(whole - latency, 1e-9)
    return LoadCost(bytes_per_s=rate, latency_s=latency)


def _crossover_prefixes(model: Transformer, settings: ProfileSettings) -> tuple[MemoryStore, list[RestoreJob]]:
    """Random prefixes over the crossover grid, saved once in memory (the link is emulated per rate)."""
    store = MemoryStore()
    jobs = []
    for k in settings.crossover_chunks:
        n = max(1, int(k * settings.chunk_size))
        job = make_job(model, torch.randint(0, model.config.vocab_size, (n,)).tolist(), tenant="profile",
                       chunk_size=settings.chunk_size, layers=model.layers)
        save_prefix(model, job, store)
        jobs.append(job)
    return store, jobs


def _measure_crossover(model: Transformer, costs: CostModel, settings: ProfileSettings, ratio: float,
                       prefixes: tuple[MemoryStore, list[RestoreJob]], checks: list[MonotoneCheck]) -> Crossover:
    raw, jobs = prefixes
    c, n_layers = settings.chunk_size, len(model.layers)
    mid = len(jobs[len(jobs) // 2].token_ids)
    bytes_mid = mid * n_layers * model.kv_bytes_per_token_per_layer
    comp_mid = sum(costs.chunk_compute_s(p, min(p + c, mid), n_layers) for p in range(0, mid, c))
    rate = bytes_mid / (ratio * comp_mid)
    linked = costs.with_link(rate)

    def time_restore(mode: str, i: int) -> float:
        return min(restore(jobs[i], model=model, store=ShapedStore(raw, TokenBucket(rate)), policy=mode,
                           costs=linked).elapsed_s for _ in range(max(1, settings.repeats - 1)))

    times = {}
    for mode in ("cacheflow-token", "cacheflow-layer"):
        measured = [time_restore(mode, i) for i in range(len(jobs))]
        times[mode], check = settle_monotone(f"{mode} restore vs length at Tio/Tcomp={ratio}", measured,
                                             partial(time_restore, mode))
        checks.append(check)
    table = [{"n_tokens": float(len(job.token_ids)), "token_s": times["cacheflow-token"][i],
              "layer_s": times["cacheflow-layer"][i]} for i, job in enumerate(jobs)]
    return Crossover(link_bytes_per_s=rate, l_delta=crossover_length(table), table=tuple(table))


def crossover_length(table: Sequence[dict[str, float]]) -> int:
    """Shortest length from which token-wise is never slower than layer-wise.

    Past the grid the winner at its longest length is assumed: if layer-wise still wins there, L_delta
    is `NEVER_TOKEN_WISE` (a GPU with per-chunk launch overhead can make token-wise lose everywhere).
    """
    if table[-1]["token_s"] > table[-1]["layer_s"]:
        return NEVER_TOKEN_WISE
    l_delta = int(table[-1]["n_tokens"])
    for row in reversed(table):
        if row["token_s"] > row["layer_s"]:
            break
        l_delta = int(row["n_tokens"])
    return l_delta
