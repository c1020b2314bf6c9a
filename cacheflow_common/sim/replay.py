"""Trace requests made replayable on a real cluster: a slice of the Mooncake conversation trace with token ids.

Only requests whose prefix is mostly in storage are kept (cached >= `min_cached_share` of the input:
the restore is what is measured), lengths are divided by `token_scale` (a 512-token hash block becomes
512 / token_scale tokens) and capped, and arrival times are multiplied by `time_scale`. A block's token
ids are a fixed function of its hash id, so requests that share blocks share prefixes (and chunk keys).

A slice can be saved (`save_slice`: the trace lines' requests with their hash ids and the prefix the
trace before them cached), so that the demo ships the few requests it replays instead of the trace.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from cacheflow_common.errors import ConfigError
from cacheflow_common.sim.trace import BLOCK_TOKENS, TraceRequest, open_trace, read_trace

VOCAB = 4096  # token ids are drawn below this (the tiny model's vocabulary; SmolLM2's is larger)


@dataclass(frozen=True)
class TraceRecord:
    request: TraceRequest  # unscaled, as the trace has it (cached: what the lines before it left)
    hash_ids: list[int]


@dataclass(frozen=True)
class ReplayRequest:
    trace: TraceRequest  # scaled: lengths in tokens of the replay, arrival in seconds from the first
    token_ids: list[int]


def block_tokens(hash_id: int, n: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(VOCAB) for _ in range(n)]


def read_records(path: Path, *, start: int, scan: int) -> list[TraceRecord]:
    """Trace lines `start .. start + scan` with their hash ids."""
    hashes = _hash_ids(path, start, scan)
    return [TraceRecord(r, hashes[int(r.request_id)]) for r in read_trace(path, start=start, count=scan)]


def select_requests(records: list[TraceRecord], *, count: int, token_scale: int, max_tokens: int,
                    time_scale: float, min_cached_share: float = 0.5, min_cached: int = 0) -> list[ReplayRequest]:
    """The first `count` records that qualify (at least `min_cached` scaled tokens cached), scaled for replay."""
    block = BLOCK_TOKENS // token_scale
    chosen: list[ReplayRequest] = []
    for record in records:
        r = record.request
        n, cached = -(-r.input_length // token_scale), r.cached_tokens // token_scale
        if n > max_tokens or cached < min_cached_share * n or cached < max(block, min_cached):
            continue
        ids = [t for h in record.hash_ids for t in block_tokens(h, block)][:n]
        chosen.append(ReplayRequest(replace(r, input_length=n, cached_tokens=min(cached, n - 1)), ids))
        if len(chosen) == count:
            break
    t0 = chosen[0].trace.arrival_s if chosen else 0.0
    return [ReplayRequest(replace(c.trace, arrival_s=(c.trace.arrival_s - t0) * time_scale), c.token_ids)
            for c in chosen]


def save_slice(path: Path, records: list[TraceRecord], source: str) -> None:
    body = {"source": source, "records": [{**asdict(r.request), "hash_ids": r.hash_ids} for r in records]}
    path.write_text(json.dumps(body, separators=(",", ":")) + "\n")


def load_slice(path: Path) -> list[TraceRecord]:
    try:
        body = json.loads(path.read_text())
        return [TraceRecord(TraceRequest(**{k: v for k, v in r.items() if k != "hash_ids"}), list(r["hash_ids"]))
                for r in body["records"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read trace slice {path}: {exc}") from exc


def _hash_ids(path: Path, start: int, scan: int) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    with open_trace(path) as f:
        for index, line in enumerate(f):
            if index >= start + scan:
                break
            if index >= start:
                out[index] = [int(h) for h in json.loads(line)["hash_ids"]]
    return out
