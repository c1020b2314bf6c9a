"""Request traces for the simulator: the Mooncake format (JSON lines of `timestamp` in ms,
`input_length`, `output_length`, `hash_ids` = ids of 512-token blocks).

A block id seen in an earlier request is cached, so a request's cached prefix is its longest run of
leading block ids already seen (in tokens, capped at its input length): that prefix is restored, the
rest of the input is prefilled. Blocks are marked seen from the first line of the file, so a slice
starting mid-trace finds the cache its earlier requests left.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, NamedTuple

from cacheflow_common.errors import ConfigError

BLOCK_TOKENS = 512  # the Mooncake trace's hash block size


@dataclass(frozen=True, kw_only=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    input_length: int
    cached_tokens: int  # the restored prefix; input_length - cached_tokens is prefilled
    output_length: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.cached_tokens <= self.input_length:
            raise ConfigError(f"request {self.request_id}: cached prefix {self.cached_tokens} is not within "
                              f"its input of {self.input_length} tokens")


def read_trace(path: str | Path, *, start: int = 0, count: int | None = None, time_scale: float = 1.0,
               block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    """Requests `start .. start + count` of the trace, arriving from 0 s, timestamps times `time_scale`.

    `time_scale` < 1 compresses the trace (more load), > 1 stretches it.
    """
    try:
        with open_trace(path) as f:
            return parse_trace(f, start=start, count=count, time_scale=time_scale, block_tokens=block_tokens)
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from exc


def open_trace(path: str | Path) -> IO[str]:
    """A trace file as text lines; a `.gz` file is decompressed as it is read."""
    path = Path(path)
    return gzip.open(path, "rt") if path.suffix == ".gz" else open(path)


def parse_trace(lines: Iterable[str], *, start: int = 0, count: int | None = None, time_scale: float = 1.0,
                block_tokens: int = BLOCK_TOKENS) -> list[TraceRequest]:
    if start < 0 or (count is not None and count < 0) or time_scale <= 0 or block_tokens <= 0:
        raise ConfigError("trace slice needs start >= 0, count >= 0, time_scale > 0 and block_tokens > 0")
    seen: set[int] = set()
    out: list[TraceRequest] = []
    stop = None if count is None else start + count
    for index, line in enumerate(lines):
        if stop is not None and index >= stop:
            break
        record = _record(line, index)
        cached_blocks = next((i for i, h in enumerate(record.hash_ids) if h not in seen), len(record.hash_ids))
        seen.update(record.hash_ids)
        if index >= start:
            out.append(TraceRequest(
                request_id=str(index),
                arrival_s=record.timestamp_ms / 1000.0,
                input_length=record.input_length,
                cached_tokens=min(cached_blocks * block_tokens, record.input_length),
                output_length=record.output_length,
            ))
    t0 = out[0].arrival_s if out else 0.0
    return [replace(r, arrival_s=(r.arrival_s - t0) * time_scale) for r in out]


class _Line(NamedTuple):
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _record(line: str, index: int) -> _Line:
    try:
        record = json.loads(line)
        return _Line(timestamp_ms=float(record["timestamp"]), input_length=int(record["input_length"]),
                     output_length=int(record.get("output_length", 0)),
                     hash_ids=tuple(int(h) for h in record["hash_ids"]))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ConfigError(f"trace line {index + 1} is not a request ({exc!r})") from exc
