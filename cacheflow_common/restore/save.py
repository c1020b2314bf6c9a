"""The save path: compute a prefix's KV (chunked prefill) and store it as chunk objects.

Encoding uses torch: it runs after a prefill, off the restore's hot path.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cacheflow_common.kv.chunk import encode_kv_chunk
from cacheflow_common.kv.keys import ChunkKey, HeadRange, chunk_keys, object_name, tenant_salt
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.store.base import ChunkStore

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES[dtype]


def make_job(
    model: Transformer,
    token_ids: Sequence[int],
    *,
    tenant: str,
    chunk_size: int,
    layers: range | None = None,
    quant: str = "none",
    kv_dtype: str = "",
    fingerprint: str = "",
    heads: HeadRange | None = None,
) -> RestoreJob:
    """The restore job for `token_ids` under `tenant`, keys salted by `fingerprint` (by default the model's);
    its chunks hold KV in `kv_dtype` (by default the model's dtype), of the model's KV heads `heads` (a
    tensor-parallel rank's; None: all)."""
    keys = chunk_keys(token_ids, chunk_size, tenant_salt(fingerprint or model.fingerprint(), tenant))
    return RestoreJob(
        token_ids=tuple(token_ids),
        keys=tuple(keys),
        layers=layers if layers is not None else range(model.config.num_layers),
        kv_dtype=kv_dtype or dtype_name(model.dtype),
        quant=quant,
        heads=heads,
    )


def compute_prefix_kv(model: Transformer, job: RestoreJob) -> KVBuffer:
    """Chunked prefill of the job's prefix through its layers (stage 0 input: token embeddings)."""
    ids = torch.tensor(job.token_ids, dtype=torch.long)  # [N]
    return prefill_stage(model, job, model.embed(ids))[0]


def prefill_stage(model: Transformer, job: RestoreJob, hidden_in: torch.Tensor) -> tuple[KVBuffer, torch.Tensor]:
    """Chunked prefill of the job's layers from hidden_in [N, hidden] entering `job.layers.start`.

    Returns the stage's KV and the hidden state leaving it, [N, hidden] (the next stage's boundary).
    """
    kv = model.new_kv(job.layers, max(1, len(job.token_ids)))
    out = torch.empty_like(hidden_in)  # [N, hidden]
    for key in job.keys:
        rows = slice(key.token_start, key.token_end)
        out[rows] = model.forward_layers(hidden_in[rows], job.layers,
                                         [Span(kv, key.token_start, key.token_end - key.token_start)])
    return kv, out


def save_chunks(kv: KVBuffer, job: RestoreJob, store: ChunkStore, *, model_fingerprint: str,
                keys: Sequence[ChunkKey] | None = None) -> int:
    """Store the chunks `keys` (default: all of the job's) of `kv`; returns the bytes written."""
    lo = job.layers.start - kv.layer_start
    written = 0
    for key in keys if keys is not None else job.keys:
        part = kv.data[lo : lo + len(job.layers), :, :, key.token_start : key.token_end]  # [L, 2, Hkv, T, D]
        written += put_chunk(store, key, job.token_ids, part, model_fingerprint=model_fingerprint, layers=job.layers,
                             dtype=job.kv_dtype, quant=job.quant, heads=job.heads)
    return written


def put_chunk(store: ChunkStore, key: ChunkKey, token_ids: Sequence[int], kv: torch.Tensor, *, model_fingerprint: str,
              layers: range, dtype: str, quant: str = "none", heads: HeadRange | None = None) -> int:
    """Store one chunk: kv [len(layers), 2, Hkv, T, D] of its tokens (`token_ids`: the whole prefix's), its
    KV stored in `dtype`; `heads`: the model's KV heads kv holds (None: all); returns the bytes written."""
    obj = encode_kv_chunk(key=key, token_ids=token_ids[key.token_start : key.token_end], model=model_fingerprint,
                          layer_start=layers.start, kv=kv, dtype=dtype, quant=quant, heads=heads)
    store.put(object_name(key, "kv", layers.start, layers.stop, heads), obj)
    return len(obj)


def save_prefix(model: Transformer, job: RestoreJob, store: ChunkStore) -> KVBuffer:
    """Prefill the job's prefix and store every chunk; returns the computed KV."""
    kv = compute_prefix_kv(model, job)
    save_chunks(kv, job, store, model_fingerprint=model.fingerprint())
    return kv
