"""The requests the batch benchmark replays: a slice of the Mooncake conversation trace, scaled to this CPU.

Only requests whose prefix is mostly in storage are kept (cached >= `min_cached_share` of the input:
the restore is what is measured), lengths are divided by `token_scale` (a 512-token hash block becomes
512 / token_scale tokens) and capped, and arrival times are multiplied by `time_scale`. A block's token
ids are a fixed function of its hash id, so requests that share blocks share prefixes (and chunk keys).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from cacheflow_common.sim.trace import BLOCK_TOKENS, TraceRequest, read_trace

TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
VOCAB = 4096  # token ids are drawn below this (the tiny model's vocabulary)


@dataclass(frozen=True)
class ReplayRequest:
    trace: TraceRequest  # scaled: lengths in tokens of the replay, arrival in seconds from the first
    token_ids: list[int]


def block_tokens(hash_id: int, n: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(VOCAB) for _ in range(n)]


def select_requests(path: Path, *, start: int, count: int, token_scale: int, max_tokens: int,
                    time_scale: float, min_cached_share: float = 0.5, scan: int = 3000) -> list[ReplayRequest]:
    """`count` requests from trace line `start` on (within `scan` lines), scaled for replay."""
    block = BLOCK_TOKENS // token_scale
    hashes = _hash_ids(path, start, scan)
    chosen: list[ReplayRequest] = []
    for r in read_trace(path, start=start, count=scan):
        n, cached = -(-r.input_length // token_scale), r.cached_tokens // token_scale
        if n > max_tokens or cached < min_cached_share * n or cached < block:
            continue
        ids = [t for h in hashes[int(r.request_id)] for t in block_tokens(h, block)][:n]
        chosen.append(ReplayRequest(replace(r, input_length=n, cached_tokens=min(cached, n - 1)), ids))
        if len(chosen) == count:
            break
    t0 = chosen[0].trace.arrival_s if chosen else 0.0
    return [ReplayRequest(replace(c.trace, arrival_s=(c.trace.arrival_s - t0) * time_scale), c.token_ids)
            for c in chosen]


def _hash_ids(path: Path, start: int, scan: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    with open(path) as f:
        for index, line in enumerate(f):
            if index >= start + scan:
                break
            if index >= start:
                out[index] = [int(h) for h in json.loads(line)["hash_ids"]]
    return out
