"""Which model CacheFlow recomputes with inside vLLM, chosen once and logged once:

* `runtime: "vllm"` (the default): vLLM's own model runs the restore's front (`vllm_runtime.py`); where vLLM's
  model cannot be reached (or, on a pipeline rank after the first, takes more from the rank before than a
  residual stream), restores fail and vLLM recomputes them.
* `runtime: "cacheflow"`: CacheFlow's runtime over vLLM's loaded weights, wrapped without copying one
  (`shared.py`), or — where the wrapper does not cover the model, vLLM's model cannot be reached, or
  `share_weights` is off — over a separate copy loaded from the model directory.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.transformer import Transformer
from cacheflow_services.vllm_connector.adapters import AdapterScope
from cacheflow_services.vllm_connector.model_identity import KVGeometry
from cacheflow_services.vllm_connector.shared import Unsupported, shared_bytes, shared_runtime
from cacheflow_services.vllm_connector.vllm_runtime import VllmRuntime

log = logging.getLogger(__name__)

VllmModel = Callable[[], Any]  # vLLM's loaded model module, or None while it cannot be reached
LoraManager = Callable[[Any], Any]  # vLLM's model -> its runner's LoRA manager, or None (LoRA off, or out of reach)
Drafter = Callable[[Any], Any]  # vLLM's model -> its runner's draft model, or None (no draft, or out of reach)
Event = Callable[..., None]  # the connector's stats log: event(kind, **fields)


class RuntimeChoice:
    def __init__(self, model_dir: str, config: ModelConfig | KVGeometry, *, runtime: str, share_weights: bool,
                 dtype: torch.dtype, device: str, vllm_model: VllmModel, vllm_config: Any, fingerprint: str,
                 event: Event, lora_manager: LoraManager = lambda model: None) -> None:
        """`config`: CacheFlow's model config, or (`runtime: "vllm"`) the KV geometry of the model vLLM serves."""
        self.model_dir = model_dir
        self.runtime = runtime
        self.vllm_config = vllm_config
        self.fingerprint = fingerprint
        self.config = config
        self.share_weights = share_weights
        self.dtype = dtype
        self.device = device
        self.vllm_model = vllm_model
        self.event = event
        self.lora_manager = lora_manager
        self.model: Transformer | None = None  # once chosen
        self.kind = ""  # "vllm" (vLLM's model), "shared" (over vLLM's weights) or "separate" (a copy), once chosen

    def choose(self, layers: range, *, final: bool) -> None:
        """Wrap vLLM's model if it can be reached and is covered; else, once `final` (or at once where
        sharing cannot work), load the separate runtime over `layers`, logging why."""
        if self.model is not None:
            return
        if self.runtime == "vllm":
            self._vllm(layers, final=final)
            return
        if not self.share_weights:
            self._separate(layers, "share_weights is off")
            return
        module = self.vllm_model()
        if module is None:
            if final:
                self._separate(layers, "vLLM's loaded model could not be reached from the connector")
            return
        assert isinstance(self.config, ModelConfig), "CacheFlow's runtime needs the model's config"
        try:
            self.model = shared_runtime(module, self.config, dtype=self.dtype, source=Path(self.model_dir))
        except Unsupported as exc:
            self._separate(layers, str(exc))
            return
        inside, outside = shared_bytes(self.model, module)
        self.kind = "shared"
        log.info("CacheFlow recomputes with vLLM's own model (%s): no second copy of the weights",
                 type(module).__name__)
        self.event("runtime", runtime="shared", reason="", shared_bytes=inside, own_bytes=outside)

    def _vllm(self, layers: range, *, final: bool) -> None:
        """vLLM's own model; once `final` and still out of reach, restores fail (vLLM recomputes them)."""
        module = self.vllm_model()
        if module is None:
            if final:
                raise RuntimeError("vLLM's loaded model could not be reached from the connector")
            return
        assert isinstance(self.config, KVGeometry), "vLLM's model runs over the geometry of vLLM's config"
        manager = self.lora_manager(module)
        try:
            runtime = VllmRuntime(self.config, module, self.vllm_config, layers=layers, fingerprint=self.fingerprint,
                                  adapters=AdapterScope(manager) if manager is not None else None)
        except ConfigError as exc:  # a pipeline rank of a family whose ranks send more than a residual stream
            if final:
                raise RuntimeError(f"vLLM's model cannot restore this rank's layers: {exc}") from exc
            return
        self.model = cast(Transformer, runtime)  # it offers what the restore engine calls of a Transformer
        self.kind = "vllm"
        log.info("CacheFlow recomputes with vLLM's own model (%s) and attention backend", type(module).__name__)
        self.event("runtime", runtime="vllm", reason="", shared_bytes=0, own_bytes=0)

    def _separate(self, layers: range, reason: str) -> None:
        log.warning("CacheFlow recomputes with its own copy of the weights from %s: %s", self.model_dir, reason)
        self.model = Transformer.from_dir(self.model_dir, dtype=self.dtype, device=self.device, layers=layers)
        self.kind = "separate"
        own = sum(t.numel() * t.element_size() for t in self.model.weights.values())
        self.event("runtime", runtime="separate", reason=reason, shared_bytes=0, own_bytes=own)
