"""A decoder-only transformer that runs any layer range over any token range, into a KV buffer it is handed.

Positions and KV are explicit arguments (no hidden global state): `forward_layers(hidden, layers,
spans)` computes layers `layers` for packed rows of one or more requests, writes each request's K/V
at its positions into its own `KVBuffer`, and attends over the KV already there. The hidden state it
returns is the one entering `layers.stop`: a stage's boundary activation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from cacheflow_common.errors import ConfigError
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.layers import Weights, dense_mlp, linear, moe_mlp, rms_norm
from cacheflow_common.model.rope import RotaryTable, apply_rope
from cacheflow_common.model.weights import (
    checkpoint_fingerprint,
    fingerprint,
    load_weights,
    memory_tensors,
    random_weights,
    save_weights,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Span:
    """Rows [row, row + length) of a packed batch: one request's tokens at positions [start, start + length)."""

    kv: KVBuffer
    start: int
    length: int
    row: int = 0


class Transformer:
    def __init__(self, config: ModelConfig, weights: Weights, *, layers: range, source: Path | None = None,
                 device: torch.device | str = "cpu") -> None:
        """`weights` by Hugging Face name for `layers` (plus embedding, final norm, head); `source` is the
        checkpoint directory they came from, needed to fingerprint a partial load."""
        self.config = config
        self.weights = weights
        self.layers = layers
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.device = torch.device(device)
        self._source = source
        self._fingerprint: str | None = None  # computed on first use, then kept
        self._rope = RotaryTable(config.rope, config.head_dim, self.device)

    @classmethod
    def from_dir(cls, path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
                 layers: range | None = None) -> Transformer:
        path = Path(path)
        config = ModelConfig.from_dir(path)
        layers = layers if layers is not None else range(config.num_layers)
        if layers.start < 0 or layers.stop > config.num_layers or layers.step != 1:
            raise ConfigError(f"layers {layers} are not a contiguous range within the model's {config.num_layers}")
        dtype = dtype or _DTYPES[config.dtype]
        weights = load_weights(path, config, layers=layers, dtype=dtype, device=device)
        return cls(config, weights, layers=layers, source=path, device=device)

    @classmethod
    def random(cls, config: ModelConfig, *, seed: int, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> Transformer:
        weights = random_weights(config, seed=seed, dtype=dtype, device=device)
        return cls(config, weights, layers=range(config.num_layers), device=device)

    def save(self, path: str | Path) -> None:
        """config.json + model.safetensors with Hugging Face names (loadable by transformers)."""
        if self.layers != range(self.config.num_layers):
            raise ConfigError("only a model with all its layers loaded can be saved")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        hf = self.config.to_hf_dict()
        hf["dtype"] = str(self.dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(hf, indent=2))
        save_weights(path, self.weights)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.weights)

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer, in the dtype this model computes (and stores) KV in."""
        return 2 * self.config.num_kv_heads * self.config.head_dim * self.dtype.itemsize

    def new_kv(self, layers: range, capacity: int) -> KVBuffer:
        """An empty KV buffer for `layers` and `capacity` tokens, in this model's dtype and on its device."""
        return KVBuffer.for_model(self.config, layers=layers, capacity=capacity, dtype=self.dtype, device=self.device)

    def synchronize(self) -> None:
        """Wait for the work queued on this model's device (a no-op on the CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def fingerprint(self) -> str:
        """32 hex chars identifying config, compute dtype and every byte of the weights; equal for every
        layer range of one checkpoint (hashed from its files once, then kept beside them)."""
        if self._fingerprint is None:
            if self._source is not None:  # from the files: every stage agrees, whatever layers it loaded
                self._fingerprint = checkpoint_fingerprint(self._source, self.config, self.dtype)
            else:
                self._fingerprint = fingerprint(self.config, memory_tensors(self.weights))
        return self._fingerprint

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden]."""
        return F.embedding(token_ids.to(self.device), self.weights["model.embed_tokens.weight"])

    @torch.inference_mode()
    def forward_layers(self, hidden: torch.Tensor, layers: range, spans: Sequence[Span]) -> torch.Tensor:
        """Run `layers` over packed rows `hidden` [R, hidden]; returns the hidden state entering `layers.stop`.

        Returns once the KV writes are done (on a GPU it waits for the device), so a restore's two
        pointers see when a unit is really there.
        """
        if len(layers) and (layers.step != 1 or layers.start < self.layers.start or layers.stop > self.layers.stop):
            raise ConfigError(f"layers {layers} are not loaded (this model holds {self.layers})")
        if not len(layers):
            return hidden
        rows = _span_rows(spans, hidden.shape[0])
        for layer in layers:
            hidden = self._layer(layer, hidden, spans, rows)
        self.synchronize()
        return hidden

    def _layer(self, layer: int, x: torch.Tensor, spans: Sequence[Span], rows: Sequence[int]) -> torch.Tensor:
        c, w, p = self.config, self.weights, f"model.layers.{layer}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps)  # [R, hidden]
        q = linear(h, w, p + "self_attn.q_proj")  # [R, H*D]
        k = linear(h, w, p + "self_attn.k_proj")  # [R, Hkv*D]
        v = linear(h, w, p + "self_attn.v_proj")  # [R, Hkv*D]
        out = torch.empty_like(q)  # [R, H*D]
        for span, r0 in zip(spans, rows, strict=True):
            r1 = r0 + span.length
            out[r0:r1] = self._attend(layer, span, q[r0:r1], k[r0:r1], v[r0:r1])
        x = x + linear(out, w, p + "self_attn.o_proj")  # [R, hidden]
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        mlp = moe_mlp(h, w, p + "mlp.", c) if c.layer_is_moe(layer) else dense_mlp(h, w, p + "mlp.")
        return x + mlp

    def _attend(self, layer: int, span: Span, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One request's attention: q [T, H*D], k/v [T, Hkv*D] -> [T, H*D]; writes its K/V into span.kv."""
        c, w, p = self.config, self.weights, f"model.layers.{layer}.self_attn."
        t, start, end = span.length, span.start, span.start + span.length
        qh = q.view(t, c.num_heads, c.head_dim).transpose(0, 1)  # [H, T, D]
        kh = k.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)  # [Hkv, T, D]
        vh = v.view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)  # [Hkv, T, D]
        if c.qk_norm:
            qh = rms_norm(qh, w[p + "q_norm.weight"], c.rms_norm_eps)
            kh = rms_norm(kh, w[p + "k_norm.weight"], c.rms_norm_eps)
        cos, sin = self._rope.at(start, end, q.dtype)  # [T, D] each
        qh, kh = apply_rope(qh, cos, sin), apply_rope(kh, cos, sin)
        o = span.kv.attend(layer, start, qh, kh, vh)  # [H, T, D]
        return o.transpose(0, 1).reshape(t, c.num_heads * c.head_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, vocab] float32: final norm and LM head (tied to the embedding if configured)."""
        w = self.weights
        h = rms_norm(hidden, w["model.norm.weight"], self.config.rms_norm_eps)
        head = w["model.embed_tokens.weight"] if self.config.tie_word_embeddings else w["lm_head.weight"]
        return F.linear(h, head).float()


def _span_rows(spans: Sequence[Span], n_rows: int) -> list[int]:
    """First row of each span: consecutive in span order when all rows are 0, else as given.

    The spans must tile [0, n_rows) exactly (no gap, no overlap).
    """
    if any(s.length <= 0 or s.start < 0 for s in spans):
        raise ValueError("every span needs length > 0 and start >= 0")
    starts = [s.row for s in spans]
    if not any(starts):
        starts = [sum(s.length for s in spans[:i]) for i in range(len(spans))]
    covered = 0
    for r0, s in sorted(zip(starts, spans, strict=True), key=lambda p: p[0]):
        if r0 != covered:
            raise ValueError(f"span rows {starts} (lengths {[s.length for s in spans]}) do not tile the batch")
        covered += s.length
    if covered != n_rows:
        raise ValueError(f"spans cover {covered} rows but hidden has {n_rows}")
    return starts
