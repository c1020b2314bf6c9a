"""What the connector needs to know of the model vLLM serves, taken from vLLM's loaded config so that any
family vLLM runs works: the KV geometry (its chunks' shape), the dtype its cache holds KV in, and the
fingerprint that salts every chunk key.

The fingerprint of a family CacheFlow's own runtime implements is the one CacheFlow's stage workers use
(`checkpoint_fingerprint`: a vLLM instance and a CacheFlow cluster share chunks). Any other checkpoint is
identified by its files: a Hub snapshot by its repository and commit (immutable by construction, nothing to
read), a local directory by every byte of its config and weight files, hashed once and kept beside them
(`fingerprint_cache.py`). Either way the compute dtype is part of it: other dtype, other KV.

An fp8 cache's chunks hold its bytes as they are (vLLM quantizes with the model's own scales, 1 where the
checkpoint has none): their fingerprint is the whole checkpoint's files (scales included), the fp8 format and
the cache's layout, so they are restored only into a cache that reads those bytes the same way.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.kv.keys import HeadRange
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.fingerprint_cache import cached_fingerprint
from cacheflow_common.model.weights import checkpoint_fingerprint
from cacheflow_common.restore.head_sources import split_of

READ_BYTES = 16 << 20  # a weight file is hashed this much at a time
SNAPSHOT = re.compile(r"models--(?P<repo>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})$")


@dataclass(frozen=True)
class KVGeometry:
    """The shape of a model's KV, as a chunk holds it: [num_layers, 2, num_kv_heads, T, head_dim] (the KV heads
    of one tensor-parallel rank)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @classmethod
    def from_vllm(cls, vllm_config: Any) -> KVGeometry:
        model = vllm_config.model_config
        return cls(num_layers=model.get_total_num_hidden_layers(),
                   num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),  # this rank's
                   head_dim=model.get_head_size(), hidden_size=model.get_hidden_size())


FP8 = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}  # vLLM's cache dtype -> chunk dtype


def kv_dtype(vllm_config: Any) -> str:
    """The chunk dtype of vLLM's KV cache: the model's dtype ("auto"), or an fp8 format."""
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype == "auto":
        return str(vllm_config.model_config.dtype).removeprefix("torch.")
    if cache_dtype not in FP8:
        raise ConfigError(f"KV cache dtype {cache_dtype}: the connector stores model-dtype or fp8 KV only")
    return FP8[cache_dtype]


def chunk_fingerprint(model_dir: Path, vllm_config: Any, layout: str) -> str:
    """What every chunk key of this vLLM instance is salted with (both connector sides compute it alike). It
    does not depend on tensor parallelism: a rank's chunks are objects holding its KV heads (`rank_heads`),
    which an instance of any tensor-parallel size reads its own heads out of."""
    dtype = vllm_config.model_config.dtype
    if not fingerprint_needs_layout(vllm_config):
        return model_fingerprint(model_dir, dtype)
    return _digest(f"{files_fingerprint(model_dir, dtype)}|{kv_dtype(vllm_config)}|{layout}".encode())


def fingerprint_needs_layout(vllm_config: Any) -> bool:
    """Whether chunk keys depend on the cache's layout: an fp8 cache's chunks hold its bytes as they are; a
    model-dtype cache's are stored in CacheFlow's own [2, Hkv, T, D] whatever the kernel (paged.py)."""
    return vllm_config.cache_config.cache_dtype != "auto"


def rank_heads(vllm_config: Any, tp_rank: int | None, model_config: Any = None) -> HeadRange | None:
    """The KV heads tensor-parallel rank `tp_rank` holds of the model's (`model_config`: another's vLLM runs
    beside it on the same ranks, a speculative draft's) (None without tensor parallelism: all)."""
    tp = vllm_config.parallel_config.tensor_parallel_size
    if tp == 1:
        return None
    assert tp_rank is not None, "a tensor-parallel rank holds the KV heads of its rank"
    model_config = model_config or vllm_config.model_config
    return HeadRange.of_rank(model_config.get_total_num_kv_heads(), tp, tp_rank)


def head_split(vllm_config: Any) -> int:
    """Into how many runs the instance's ranks split the model's KV heads (1: one object holds them all)."""
    total, tp = vllm_config.model_config.get_total_num_kv_heads(), vllm_config.parallel_config.tensor_parallel_size
    return split_of(HeadRange.of_rank(total, tp, 0))


def salted(fingerprint: str, salt: str) -> str:
    """The fingerprint a request's chunk keys are salted with: the instance's, and the request's own salt
    (its LoRA adapter, its cache_salt) where it has one."""
    return _digest(f"{fingerprint}|request salt|{salt}".encode()) if salt else fingerprint


def adapter_fingerprint(adapter_dir: Path) -> str:
    """A LoRA adapter's identity: every byte of its config and weight files (hashed once, kept beside them)."""
    return _hashed_dir(adapter_dir, "adapter_config.json", "adapter")


def model_fingerprint(model_dir: Path, dtype: torch.dtype) -> str:
    """The fingerprint chunk keys are salted with, for the checkpoint at `model_dir` computed in `dtype`."""
    try:
        config = ModelConfig.from_dir(model_dir)
    except ConfigError:
        return files_fingerprint(model_dir, dtype)
    return checkpoint_fingerprint(model_dir, config, dtype)


def files_fingerprint(model_dir: Path, dtype: torch.dtype) -> str:
    """blake2b-128 of the checkpoint's identity and `dtype`: a Hub snapshot's repository and commit, else the
    bytes of config.json and every weight file (hashed once, then kept beside them)."""
    variant = "files-" + str(dtype).removeprefix("torch.")
    snapshot = SNAPSHOT.search(model_dir.resolve().as_posix()) or SNAPSHOT.search(model_dir.as_posix())
    if snapshot is not None:
        return _digest(f"hub|{snapshot['repo']}|{snapshot['commit']}|{variant}".encode())
    return _hashed_dir(model_dir, "config.json", variant)


def _hashed_dir(root: Path, config_name: str, variant: str) -> str:
    """blake2b-128 of `variant` and the bytes of `config_name` and every weight file in `root` (hashed once,
    then kept beside them)."""
    config = root / config_name
    if not config.is_file():
        raise ConfigError(f"no {config_name} in {root}")
    files = sorted([config, *root.glob("*.safetensors"), *root.glob("*.bin")])
    return cached_fingerprint(root, files, variant, lambda: _hash_files(root, files, variant))


def _hash_files(root: Path, files: list[Path], variant: str) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(variant.encode())
    for file in files:
        h.update(f"|{file.relative_to(root)}|{file.stat().st_size}|".encode())
        with file.open("rb") as f:
            while block := f.read(READ_BYTES):
                h.update(block)
    return h.hexdigest()


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()
