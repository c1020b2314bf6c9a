"""Recompute with vLLM's own model: a restore's front runs as chunked-prefill forwards of the model vLLM
serves (its family, its layers, its weights as loaded, its attention backend), writing K and V straight into
the request's blocks in the cache's own dtype and layout.

Each compute unit of the restore engine becomes one forward of vLLM's top-level model over the unit's tokens
at their positions, with the chunks before them already in the blocks as context — what vLLM's own
chunked prefill does. The attention metadata comes from the backend's own metadata builder (one per
backend and KV cache spec, as vLLM's model runner makes them), so a sliding window, a softcap or another
backend is the backend's business. Several restores' units of one engine step run as one forward over a
batch of requests, of at most vLLM's token budget (`max_num_batched_tokens`, which sizes the buffers of
vLLM's attention and LoRA metadata): a larger batch runs as several forwards, a request cut between two
like a chunked prefill. Loaded chunks are written into the blocks as they land (`BlockKV`), so a unit finds
them there. With LoRA on, each forward runs under its requests' adapters (`adapters.py`).

On a pipeline-parallel rank after the first, a forward starts from the restore's stored boundary
activations (the residual stream entering the rank's first layer), handed to vLLM's model as what the rank
before would send (`IntermediateTensors`): hidden_states, and a zero residual where the family sends one (its
first layer adds the two). A rank before the last returns the residual stream leaving its last layer.

The model is called past its module hooks (`module.forward`): the boundary capture's pre-hook (`ranks.py`) is
for vLLM's own forwards, and must not file a restore's rows as the step's.

Token-wise only: a layer-wise unit would run the model's decoder layers one at a time, whose signatures
differ by family. Called on vLLM's thread only (the connector computes there: `async_loads.py` says why).

It holds no weights and no model code of its own, so it is not a CacheFlow `Transformer`: it offers the
part of one the restore engine calls (`embed`, `forward_layers`, `new_kv`, `fingerprint`, the KV size).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, cast

import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.kv.chunk import TORCH_DTYPES
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span
from cacheflow_services.vllm_connector.adapters import AdapterScope
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.model_identity import KVGeometry, kv_dtype
from cacheflow_services.vllm_connector.plan import Adapter


class VllmRuntime:
    """The restore engine's model, backed by vLLM's loaded `module` over all the rank's `layers`."""

    def __init__(self, config: KVGeometry, module: Any, vllm_config: Any, *, layers: range, fingerprint: str,
                 adapters: AdapterScope | None = None) -> None:
        """`adapters`: vLLM's LoRA adapters, where LoRA is on (every forward then sets its own mapping)."""
        self.config = config
        self.module = module
        self.vllm_config = vllm_config
        self.layers = layers
        self.device = next(module.parameters()).device
        self.dtype: torch.dtype = vllm_config.model_config.dtype
        self.weights: dict[str, torch.Tensor] = {}  # vLLM's module holds them all
        self._fingerprint = fingerprint
        self.adapters = adapters
        self.max_rows: int = vllm_config.scheduler_config.max_num_batched_tokens  # rows per forward, at most
        self._builders: list[tuple[Any, list[str]]] | None = None  # (metadata builder, its layers), at first use
        self._sent = () if layers.start == 0 else sent_between_ranks(module, self.dtype, self.device)

    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """One token's K and V in one layer as the cache (and its chunks) hold it: this rank's heads, the
        cache's dtype (fp8 included)."""
        return 2 * self.config.num_kv_heads * self.config.head_dim * TORCH_DTYPES[kv_dtype(self.vllm_config)].itemsize

    def new_kv(self, layers: range, capacity: int) -> KVBuffer:
        return KVBuffer(layer_start=layers.start, layer_end=layers.stop, num_kv_heads=self.config.num_kv_heads,
                        head_dim=self.config.head_dim, capacity=capacity, dtype=self.dtype, device=self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden], as vLLM's model embeds its input (a family's scaling included; with
        LoRA on, the base model's embeddings: `adapters.py`)."""
        ids = token_ids.to(self.device)
        if not len(ids):
            return self.module.embed_input_ids(ids)
        parts = []
        for start in range(0, len(ids), self.max_rows):
            piece = ids[start : start + self.max_rows]  # [t]
            with self._mapped([(None, len(piece))]):
                parts.append(self.module.embed_input_ids(piece))  # [t, hidden]
        return torch.cat(parts) if len(parts) != 1 else parts[0]

    @torch.inference_mode()
    def forward_layers(self, hidden: torch.Tensor, layers: range, spans: Sequence[Span]) -> torch.Tensor:
        """vLLM's model over packed rows `hidden` [R, hidden] (embedded tokens), one span per request, packed
        in the spans' order; the KV of every layer lands in each span's blocks. Returns the model's output
        [R, hidden]."""
        if layers != self.layers:
            raise ConfigError(f"vLLM's model runs all the rank's layers {self.layers}, not {layers}: token-wise only")
        outs = []
        for group in forward_groups(spans, self.max_rows):
            first, last = group[0], group[-1]
            outs.append(self._forward(hidden[first.row : last.row + last.length], group))  # [r, hidden]
        self.synchronize()
        return torch.cat(outs) if len(outs) != 1 else outs[0]

    def _forward(self, hidden: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
        """One forward of vLLM's model over rows `hidden` [r, hidden], packed in the order of `spans`; a request
        that keeps its output rows (an EAGLE draft's input: `BlockKV.keep_outputs`) gets its own."""
        with self.forward_context(spans) as positions:
            out, rows = draft_rows(self.module.forward(input_ids=None, positions=positions, **self._inputs(hidden)))
        for span in spans:
            _block_kv(span).keep(span.start, rows[span.row - spans[0].row : span.row - spans[0].row + span.length])
        return residual_stream(out)

    @contextmanager
    def forward_context(self, spans: Sequence[Span]) -> Iterator[torch.Tensor]:
        """vLLM's forward context for one forward over `spans` (one batch of chunked prefills into their blocks,
        under their adapters): the attention metadata of every attention layer vLLM registered (the target's
        and a draft's). Yields the rows' positions [r]."""
        from vllm.forward_context import set_forward_context

        blocks = [_block_kv(span) for span in spans]  # loaded chunks are in them as soon as they land
        common = self._common_metadata(spans, blocks)
        metadata, slots = {}, {}
        for builder, names in self._metadata_builders():
            built = builder.build(common_prefix_len=0, common_attn_metadata=common)
            metadata.update(dict.fromkeys(names, built))
            slots.update(dict.fromkeys(names, common.slot_mapping))
        positions = torch.cat([torch.arange(s.start, s.start + s.length) for s in spans]).to(self.device)  # [r]
        with self._mapped([(kv.adapter, s.length) for kv, s in zip(blocks, spans, strict=True)]), \
                set_forward_context(metadata, self.vllm_config, num_tokens=len(positions), slot_mapping=slots):
            yield positions

    def _inputs(self, hidden: torch.Tensor) -> dict[str, Any]:
        """vLLM's model's input for rows `hidden` [r, hidden]: embedded tokens on the first rank; on a later
        one, the boundary activations as the rank before sends them."""
        if not self._sent:
            return {"inputs_embeds": hidden}
        from vllm.sequence import IntermediateTensors

        tensors = {"hidden_states": hidden}
        if "residual" in self._sent:
            tensors["residual"] = torch.zeros_like(hidden)  # [r, hidden]: the first layer adds it to hidden_states
        return {"intermediate_tensors": IntermediateTensors(tensors)}

    def _mapped(self, rows: Sequence[tuple[Adapter | None, int]]) -> AbstractContextManager[None]:
        """The LoRA mapping of `rows` (per request: its adapter, its rows) while a forward runs; nothing
        without LoRA."""
        return self.adapters.mapped(rows) if self.adapters is not None else nullcontext()

    def _common_metadata(self, spans: Sequence[Span], blocks: Sequence[BlockKV]) -> Any:
        """What vLLM's model runner hands its metadata builders for these spans as one batch of prefills."""
        from vllm.v1.attention.backend import CommonAttentionMetadata

        lengths = torch.tensor([s.length for s in spans], dtype=torch.int32)  # [B]
        query_start = torch.zeros(len(spans) + 1, dtype=torch.int32)  # [B + 1]
        query_start[1:] = torch.cumsum(lengths, 0)
        seq_lens = torch.tensor([s.start + s.length for s in spans], dtype=torch.int32)  # [B]
        width = max(len(kv.block_ids) for kv in blocks)
        table = torch.zeros(len(spans), width, dtype=torch.int32)  # [B, max blocks]
        for i, kv in enumerate(blocks):
            table[i, : len(kv.block_ids)] = torch.tensor(kv.block_ids, dtype=torch.int32)
        slots = torch.cat([_slots(kv, s.start, s.start + s.length) for s, kv in zip(spans, blocks, strict=True)])
        device = self.device
        return CommonAttentionMetadata(
            query_start_loc=query_start.to(device), query_start_loc_cpu=query_start, seq_lens=seq_lens.to(device),
            num_reqs=len(spans), num_actual_tokens=int(lengths.sum()), max_query_len=int(lengths.max()),
            max_seq_len=int(seq_lens.max()), block_table_tensor=table.to(device), slot_mapping=slots.to(device),
            causal=True, seq_lens_cpu_upper_bound=seq_lens)

    def _metadata_builders(self) -> list[tuple[Any, list[str]]]:
        """One metadata builder per (attention backend, KV cache spec) over the model's attention layers."""
        if self._builders is None:
            layers = self.vllm_config.compilation_config.static_forward_context  # name -> attention, MoE, ... module
            groups: dict[tuple[Any, Any], list[str]] = {}
            for name, layer in sorted(layers.items()):
                if not hasattr(layer, "get_kv_cache_spec"):  # not an attention layer (a fused MoE's runner, say)
                    continue
                spec = layer.get_kv_cache_spec(self.vllm_config)
                if spec is not None:
                    groups.setdefault((layer.get_attn_backend(), spec), []).append(name)
            self._builders = [(backend.get_builder_cls()(spec, names, self.vllm_config, self.device), names)
                              for (backend, spec), names in groups.items()]
        return self._builders


def sent_between_ranks(module: Any, dtype: torch.dtype, device: torch.device) -> tuple[str, ...]:
    """What the rank before sends a pipeline rank (vLLM's `IntermediateTensors` keys): the residual stream as
    hidden_states (plus a residual the first layer adds to it). Anything else (a family that also sends
    auxiliary states) cannot be rebuilt from a boundary activation: ConfigError."""
    make = getattr(module, "make_empty_intermediate_tensors", None)
    keys = tuple(sorted(make(0, dtype, device).tensors)) if make is not None else ()
    if keys not in (("hidden_states",), ("hidden_states", "residual")):
        raise ConfigError(f"vLLM's {type(module).__name__} sends {list(keys) or 'nothing'} between pipeline ranks, "
                          "not a residual stream a boundary activation rebuilds")
    return keys


def draft_rows(out: Any) -> tuple[Any, torch.Tensor]:
    """vLLM's model's output and the rows an EAGLE draft reads from it: with an EAGLE-3 draft vLLM's model
    returns (hidden_states, its auxiliary layers' residual streams), whose rows [r, k * hidden] are the draft's
    (in layer order, as vLLM concatenates them); else its output rows."""
    if isinstance(out, tuple):
        hidden, aux = out
        return hidden, torch.cat(aux, dim=-1)
    return out, out


def residual_stream(out: Any) -> torch.Tensor:
    """vLLM's model's output as rows [r, hidden]: the last rank's hidden states, or the residual stream an
    earlier rank sends on (hidden_states + residual)."""
    tensors = getattr(out, "tensors", None)
    if tensors is None:
        return cast(torch.Tensor, out)
    residual = tensors.get("residual")
    return tensors["hidden_states"] if residual is None else tensors["hidden_states"] + residual


def forward_groups(spans: Sequence[Span], max_rows: int) -> list[list[Span]]:
    """`spans`, packed in this order, in forwards of at most `max_rows` rows each, under one LoRA adapter (or
    none) each; every piece's `row` is where its rows start in the packing. A span that does not fit is cut,
    its front ending one forward and its back starting the next (whose attention then finds the front in the
    blocks). One adapter per forward: in a batch that mixes rows with and without an adapter, vLLM's CPU LoRA
    ops read a row without one (index -1) as the last slot, which applies the adapter there if that slot
    holds one (measured with max_loras 1)."""
    groups: list[list[Span]] = [[]]
    room, row = max_rows, 0
    for span in spans:
        if groups[-1] and _block_kv(groups[-1][-1]).adapter != _block_kv(span).adapter:
            groups.append([])
            room = max_rows
        done = 0
        while done < span.length:
            if room == 0:
                groups.append([])
                room = max_rows
            take = min(span.length - done, room)
            groups[-1].append(Span(span.kv, span.start + done, take, row))
            done += take
            room -= take
            row += take
    return [group for group in groups if group]


def _block_kv(span: Span) -> BlockKV:
    if not isinstance(span.kv, BlockKV):
        raise TypeError(f"vLLM's model writes into a request's blocks: a BlockKV, not {type(span.kv).__name__}")
    return span.kv


def _slots(kv: BlockKV, start: int, end: int) -> torch.Tensor:
    """The cache slots of positions [start, end): [T] int64."""
    positions = torch.arange(start, end)  # [T]
    blocks = torch.tensor(kv.block_ids, dtype=torch.long)[positions // kv.block_size]  # [T]
    return blocks * kv.block_size + positions % kv.block_size
