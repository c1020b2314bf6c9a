"""A speculative draft's own KV, stored beside the target's chunks and loaded with them, so that a restore reruns
the draft only where no stored draft KV fits (draft.py reruns it there).

vLLM writes a draft's KV as it computes a prompt: the draft's first pass over the step's positions, which vLLM
0.32 runs before it calls the connector's `wait_for_save` when a draft is on, on both of its model runners (V1
defers `finalize_kv_connector` until the drafter ran, for this; V2 calls `post_forward` after `propose`). So the
saving side finds the draft's KV of each chunk it stores in the request's blocks, in the draft's layers; a later
step writes the draft's KV of later positions only.

What that KV depends on decides its key. A draft model's KV at position i is a function of tokens [0, i]: the
chunk's own key names it. An EAGLE, EAGLE-3 or MTP draft's at i reads token i + 1 (and the target's rows up to
i): a chunk's draft KV depends on the token after it too, which its key does not cover (two prompts that share
the chunk may go on differently). Its key is the chunk's, the draft's identity and, for those drafts, the next
token (`draft_key`); a chunk whose next token is not known when it is stored (the prompt's last, whose next is
the token vLLM samples) stores no draft KV, and its draft is rerun.

The draft's identity: its checkpoint's (a directory's files, or a Hub snapshot's commit) and its method, with
the cache's dtype and layout where the cache is fp8 (its bytes as they are); an MTP draft's layers are the
target's own checkpoint's, named by the target's fingerprint. The chunks' keys carry the target, the tenant,
the LoRA adapter and the cache salt already.

Under tensor parallelism each rank stores and loads the draft's KV heads it holds, as it does the target's
(objects named by head range; a rank of another split reads its heads out of them: `loader.py`). A restore
loads each chunk's draft KV front to back up to the first that is missing, on every rank; the ranks agree on
the least (`draft.restore_drafts`), and the draft reruns from there.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cacheflow_common.kv.chunk import TORCH_DTYPES
from cacheflow_common.kv.keys import DIGEST_SIZE, ChunkKey, HeadRange
from cacheflow_common.restore.job import RestoreJob
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.restore.save import put_chunk
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.model_identity import files_fingerprint, fingerprint_needs_layout, kv_dtype
from cacheflow_services.vllm_connector.paged import gather_layers, layer_index
from cacheflow_services.vllm_connector.support import DRAFTS_FROM_ROWS, model_dir

_DOMAIN = b"cacheflow/draft-kv/v1"


def draft_key(key: ChunkKey, draft: str, next_token: int | None) -> ChunkKey:
    """The key of a draft's KV over chunk `key`: the chunk's, the draft's identity `draft`, and (a draft that reads
    the token after each position) the token after the chunk; the same positions and index."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for part in (_DOMAIN, key.digest, draft.encode(), b"" if next_token is None else next_token.to_bytes(4, "little")):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return ChunkKey(h.digest(), key.index, key.token_start, key.token_end)


def draft_identity(vllm_config: Any, target_fingerprint: str, layout: str) -> str:
    """What the draft's KV is a function of, beside the tokens and the target's rows: its weights and method (an
    MTP draft's weights are in the target's checkpoint), and an fp8 cache's dtype and layout."""
    spec = vllm_config.speculative_config
    method = str(spec.method)
    if method == "mtp":
        weights = target_fingerprint
    else:
        draft_config = spec.draft_model_config
        weights = files_fingerprint(model_dir(str(draft_config.model), getattr(draft_config, "revision", None)),
                                    vllm_config.model_config.dtype)
    cache = f"|{kv_dtype(vllm_config)}|{layout}" if fingerprint_needs_layout(vllm_config) else ""
    return f"{method}|{weights}{cache}"


@dataclass(frozen=True)
class DraftCaches:
    """The draft's layers' caches on this rank, in order, and how its chunks of them are stored."""

    caches: tuple[torch.Tensor, ...]  # each [blocks, Hkv, block_size, 2 * D], as vLLM registered them
    identity: str  # `draft_identity`
    shifted: bool  # its KV at i reads token i + 1 (EAGLE, EAGLE-3, MTP): the next token enters the key
    heads: HeadRange | None  # the draft's KV heads this rank holds (None: all)
    kv_dtype: str  # the chunks' dtype: the cache's
    layout: str  # how K and V sit in the blocks (paged.py)
    block_size: int

    @property
    def layers(self) -> range:
        """The draft's layers as its chunks number them: 0, 1, ... in vLLM's order."""
        return range(len(self.caches))

    def keys(self, keys: Sequence[ChunkKey], token_ids: Sequence[int], next_token: int | None) -> list[ChunkKey | None]:
        """The draft KV key of each of `keys` (chunks of `token_ids`; `next_token`: the one after them, if known),
        None where the draft's KV there depends on a token not known."""
        out: list[ChunkKey | None] = []
        for key in keys:
            after = token_ids[key.token_end] if key.token_end < len(token_ids) else next_token
            out.append(None if self.shifted and after is None else
                       draft_key(key, self.identity, after if self.shifted else None))
        return out

    def gather(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """A copy of the draft's KV at positions [start, end) out of the blocks: [Ld, 2, Hkv, T, D]."""
        return gather_layers(self.caches, self.layout, block_ids, self.block_size, start, end)

    def store(self, store: ChunkStore, keys: Sequence[ChunkKey], token_ids: Sequence[int], next_token: int | None,
              kv: torch.Tensor, first: int, *, fingerprint: str) -> int:
        """Store the draft's KV of each chunk in `keys` whose key is known: kv [Ld, 2, Hkv, T, D] from position
        `first`; the bytes written."""
        written = 0
        for key, drafted in zip(keys, self.keys(keys, token_ids, next_token), strict=True):
            if drafted is not None:
                part = kv[:, :, :, key.token_start - first : key.token_end - first]  # [Ld, 2, Hkv, C, D]
                written += put_chunk(store, drafted, token_ids, part, model_fingerprint=fingerprint, layers=self.layers,
                                     dtype=self.kv_dtype, heads=self.heads)
        return written

    def load(self, store: ChunkStore, job: RestoreJob, *, start: int, end: int, next_token: int | None,
             block_ids: Sequence[int]) -> tuple[int, int]:
        """Load the stored draft KV of the job's chunks over [start, end) into the request's blocks, front to back,
        up to the first missing: (where what it loaded ends, from `start`; the bytes read)."""
        chunks = [k for k in job.keys if k.token_end > start and k.token_start < end]
        drafted = self.keys(chunks, job.token_ids, next_token)
        known = next((i for i, k in enumerate(drafted) if k is None), len(drafted))
        if not known:
            return start, 0
        head_dim = self.caches[0].shape[-1] // 2
        blocks = BlockKV(layers=self.layers, num_kv_heads=self.caches[0].shape[1], head_dim=head_dim,
                         capacity=max(1, end), dtype=TORCH_DTYPES[self.kv_dtype], caches=dict(enumerate(self.caches)),
                         layout=self.layout, block_ids=block_ids, block_size=self.block_size, first_writable=start)
        keys = tuple(k for k in drafted[:known] if k is not None)
        loader = KVLoader(store=store, keys=keys, layers=self.layers, kv=blocks, dtype=self.kv_dtype, quant="none",
                          heads=self.heads)
        reached = start
        for i, key in enumerate(keys):
            if loader.load_chunk(i):
                break
            reached = min(end, key.token_end)
        blocks.seal()
        return reached, loader.bytes_read


def draft_caches(kv_caches: Mapping[str, torch.Tensor], vllm_config: Any, *, target_fingerprint: str, layout: str,
                 block_size: int, heads: HeadRange | None) -> DraftCaches | None:
    """The draft's caches among vLLM's (`kv_caches`: the draft's layers only, by name), in vLLM's order of its
    layers; None without any."""
    if not kv_caches:
        return None
    ordered = tuple(kv_caches[name] for name in sorted(kv_caches, key=layer_index))
    return DraftCaches(caches=ordered, identity=draft_identity(vllm_config, target_fingerprint, layout),
                       shifted=str(vllm_config.speculative_config.method) in DRAFTS_FROM_ROWS, heads=heads,
                       kv_dtype=kv_dtype(vllm_config), layout=layout, block_size=block_size)

