"""Boundary activations: what a pipeline stage s > 0 restores from (the third dimension of the restore).

Stage `s` owns layers `[a_s, b_s)`. Its restore's compute pointer needs, for every chunk it computes,
the hidden state entering layer `a_s`:

* stage 0: the token embeddings;
* stage s > 0, with boundary activations saved: one `hidden` chunk object per chunk at layer `a_s`
  (`BoundaryInput` reads them), so every stage restores at once, independently;
* otherwise, the pipelined fallback: the hidden states stage s-1 produces, chunk by chunk.

A boundary chunk is checked like any chunk (section checksum, key and token ids from its trailer);
one that is missing or corrupt raises `BoundaryMissingError`, since that stage cannot compute the
chunk without it: the caller falls back to the pipelined restore (or a fresh prefill).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from cacheflow_common.errors import CacheFlowError, ChunkFormatError, ConfigError
from cacheflow_common.kv.chunk import decode_hidden_chunk, encode_hidden_chunk
from cacheflow_common.kv.keys import ChunkKey, object_name
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.save import prefill_stage, save_chunks
from cacheflow_common.store.base import ChunkStore


class BoundaryMissingError(CacheFlowError):
    """A stage's boundary activation for a chunk is absent or corrupt: that stage cannot compute it."""


BOUNDARY_KIND = "hidden"  # a boundary activation: the residual stream entering a layer
# The model's output rows at layer L (the model's layer count): the last layer's hidden state after the final
# norm, what enters the LM head (and an EAGLE draft, vllm_connector/draft.py). Stored in the same format as a
# boundary activation, named apart from one: the residual stream leaving the last layer is another tensor.
OUTPUT_KIND = "output"


def boundary_name(key: ChunkKey, layer: int, kind: str = BOUNDARY_KIND) -> str:
    """The store name of a chunk's boundary activation entering absolute `layer` (or, `kind` OUTPUT_KIND, of
    its output rows, at the model's layer count)."""
    return object_name(key, kind, layer, layer + 1)


def save_boundaries(job: RestoreJob, hidden: torch.Tensor, store: ChunkStore, *, model_fingerprint: str,
                    keys: Sequence[ChunkKey] | None = None, first_row_token: int = 0,
                    kind: str = BOUNDARY_KIND) -> int:
    """Store the hidden states entering `job.layers.start` for chunks `keys` (default all), named as `kind`;
    returns bytes.

    hidden: [R, hidden], row r holding token `first_row_token + r` (rows of other chunks are not read).
    """
    written = 0
    for key in keys if keys is not None else job.keys:
        rows = hidden[key.token_start - first_row_token : key.token_end - first_row_token]  # [T, hidden]
        obj = encode_hidden_chunk(key=key, token_ids=job.token_ids[key.token_start : key.token_end],
                                  model=model_fingerprint, layer=job.layers.start, hidden=rows, dtype=job.kv_dtype)
        store.put(boundary_name(key, job.layers.start, kind), obj)
        written += len(obj)
    return written


class BoundaryInput:
    """A restore's `stage_input` for stage s > 0: the boundary activations of the chunks asked for.

    Called with a token range made of whole chunks (token mode asks for one chunk, layer mode for
    the whole prefix); returns [T, hidden] on `device`, in the dtype the chunks were stored in.

    Token mode computes chunk after chunk, so after serving chunk `i` it reads chunks `i+1 ..
    i+prefetch` in the background while chunk `i` computes: the read leaves the compute pointer's
    critical path. A prefetched chunk the loader takes instead is read for nothing (at most
    `prefetch` chunks, at the meeting point; counted in `bytes_read`). `ready` tells whether a range
    is in memory already (and starts its reads if not), so a compute loop serving many requests never
    waits on one request's read; `on_read` is called after each background read. Call `close()` when done.
    """

    def __init__(self, job: RestoreJob, store: ChunkStore, *, device: torch.device | str = "cpu",
                 prefetch: int = 1, on_read: Callable[[], None] | None = None, kind: str = BOUNDARY_KIND) -> None:
        """`kind`: the objects read (OUTPUT_KIND: the chunks' output rows, at `job.layers.start`)."""
        self.job = job
        self.kind = kind
        self.store = store
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.on_read = on_read
        self._chunk_at = {k.token_start: i for i, k in enumerate(job.keys)}
        self._ahead: dict[int, Future[torch.Tensor]] = {}  # chunk index -> its read in flight
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="boundary") if prefetch > 0 else None
        self._lock = threading.Lock()
        self.bytes_read = 0

    def close(self, *, wait: bool = True) -> None:
        """Stop reading ahead; later calls read synchronously. With `wait` False, a read in flight ends in
        the background (a caller holding a lock that `on_read` takes must not wait for it)."""
        with self._lock:
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> BoundaryInput:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def missing(self) -> list[int]:
        """Chunks whose boundary activation the store does not hold (checked before choosing the mode)."""
        layer = self.job.layers.start
        return [i for i, k in enumerate(self.job.keys) if not self.store.exists(boundary_name(k, layer, self.kind))]

    def __call__(self, start: int, end: int) -> torch.Tensor:
        indices = self._chunks(start, end)
        parts = [self._take(index) for index in indices]  # [T_i, hidden] each
        self._read_ahead(indices[-1] + 1)
        return torch.cat(parts).to(self.device)  # [T, hidden]

    def ready(self, start: int, end: int) -> bool:
        """Whether the boundary of tokens [start, end) is in memory; if not, its reads start now."""
        indices = self._chunks(start, end)
        with self._lock:
            if self._reader is None:
                return True  # no background reads: a call reads synchronously
            for index in indices:
                self._submit(index)
            return all(self._ahead[i].done() for i in indices)

    def _chunks(self, start: int, end: int) -> list[int]:
        """The chunks that make up tokens [start, end) exactly."""
        indices = []
        index = self._chunk_at.get(start)
        while index is not None and start < end:
            indices.append(index)
            start = self.job.keys[index].token_end
            index = index + 1 if index + 1 < len(self.job.keys) else None
        if start != end or not indices:
            raise ConfigError(f"boundary input asked for tokens up to {end}, not on chunk boundaries")
        return indices

    def _take(self, index: int) -> torch.Tensor:
        """Chunk `index`'s boundary [T, hidden]: from its prefetch if one was started, else read now."""
        with self._lock:
            pending = self._ahead.pop(index, None)
        if pending is None or pending.cancelled():  # never read ahead, or cancelled by close()
            return self._read(self.job.keys[index])
        return pending.result()

    def _read_ahead(self, first: int) -> None:
        with self._lock:
            if self._reader is None:
                return
            for index in range(first, min(first + self.prefetch, len(self.job.keys))):
                self._submit(index)

    def _submit(self, index: int) -> None:
        """Start reading chunk `index` in the background (once); the caller holds the lock."""
        if index not in self._ahead and self._reader is not None:
            future = self._ahead[index] = self._reader.submit(self._read, self.job.keys[index])
            if self.on_read is not None:
                on_read = self.on_read
                future.add_done_callback(lambda _: on_read())

    def _read(self, key: ChunkKey) -> torch.Tensor:
        name = boundary_name(key, self.job.layers.start, self.kind)
        obj = self.store.read(name)
        if obj is None:
            raise BoundaryMissingError(f"boundary activation {name} is not in the store")
        try:
            trailer, hidden = decode_hidden_chunk(obj)  # [T, hidden]
        except ChunkFormatError as exc:
            raise BoundaryMissingError(f"boundary activation {name} is corrupt: {exc}") from exc
        expected = list(self.job.token_ids[key.token_start : key.token_end])
        if trailer["key"] != key.hex or trailer["token_ids"] != expected:
            raise BoundaryMissingError(f"boundary activation {name} belongs to other tokens")
        with self._lock:
            self.bytes_read += len(obj)
        return hidden


def stage_jobs(job: RestoreJob, split: Sequence[range]) -> list[RestoreJob]:
    """The whole-model job `job` cut into one job per stage (same chunks and keys, the stage's layers)."""
    return [replace(job, layers=layers) for layers in split]


def save_prefix_by_stage(model: Transformer, job: RestoreJob, split: Sequence[range], store: ChunkStore) -> list[int]:
    """Prefill `job`'s prefix through every stage in turn, storing each stage's KV chunks and (for
    stages after the first) its boundary activations. Returns the boundary bytes stored per stage."""
    fingerprint = model.fingerprint()
    hidden = model.embed(torch.tensor(job.token_ids, dtype=torch.long))  # [N, hidden]
    boundary_bytes = []
    for s, stage in enumerate(stage_jobs(job, split)):
        boundary_bytes.append(save_boundaries(stage, hidden, store, model_fingerprint=fingerprint) if s else 0)
        kv, hidden = prefill_stage(model, stage, hidden)
        save_chunks(kv, stage, store, model_fingerprint=fingerprint)
    return boundary_bytes
