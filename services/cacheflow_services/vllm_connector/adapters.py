"""Recomputing under vLLM's LoRA adapters: each restore forward runs with a LoRA mapping of its own rows
(every row under its request's adapter, or none), and the step's mapping is put back after it.

vLLM's LoRA layers apply adapters by the metadata of the runner's punica wrapper, which the runner sets for
each step's batch (`set_active_loras`) before the connector's hooks run: `start_load_kv` comes before the
step's forward, `get_finished` after it but before `compute_logits`, whose LoRA logits processor reads the
same metadata. A restore's forward with the step's metadata would apply the step's adapters to the wrong
rows. So `mapped` sets a mapping of the restore's rows, and then hands vLLM's manager the step's mapping
again (the manager re-applies a mapping that differs from the last one it applied).

An adapter is used only where that evicts nothing: it is in one of vLLM's GPU slots, or goes into a free one
(loaded from its files first if vLLM's CPU cache has room for it). Otherwise the restore loads only, and
vLLM recomputes from its first miss. An adapter with embedding weights also loads only: the engine embeds
a unit's tokens without saying whose they are, so embeddings are the base model's.

Every tensor-parallel rank makes the same decisions: each holds the same adapters in the same slots, set
by the same steps.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from cacheflow_services.vllm_connector.plan import Adapter


class AdapterUnavailableError(RuntimeError):
    """A restore's adapter could not be made active without evicting another (the restore fails: vLLM
    recomputes it)."""


class AdapterScope:
    def __init__(self, manager: Any) -> None:
        """`manager`: the model runner's `lora_manager` (vLLM's `LRUCacheWorkerLoRAManager`)."""
        self._worker = manager
        self._models = manager._adapter_manager  # vLLM's LoRAModelManager: the slots and the applied mapping

    def unusable(self, adapter: Adapter | None) -> str:
        """Why a restore under `adapter` cannot recompute ("" if it can), making it active where that evicts
        nothing."""
        if adapter is None:
            return ""
        try:
            reason = self._activate(adapter)
        except Exception as exc:  # its files could not be read: vLLM would fail the request itself
            return f"LoRA adapter {adapter.name!r} could not be loaded ({type(exc).__name__}: {exc})"
        if not reason and self._has_embeddings(adapter.lora_id):
            reason = f"LoRA adapter {adapter.name!r} has embedding weights (restores embed with the base model's)"
        return reason

    @contextmanager
    def mapped(self, rows: Sequence[tuple[Adapter | None, int]]) -> Iterator[None]:
        """Run the block with the LoRA mapping of `rows`: per request in row order, its adapter (None: the
        base model) and its number of rows. The step's mapping is back afterwards."""
        from vllm.lora.layers import LoRAMapping

        for adapter in {a for a, _ in rows if a is not None}:
            if reason := self._activate(adapter):
                raise AdapterUnavailableError(reason)
        ids = [adapter.lora_id if adapter is not None else 0 for adapter, _ in rows]
        tokens = tuple(lora_id for lora_id, (_, n) in zip(ids, rows, strict=True) for _ in range(n))  # [R]
        step = self._models._last_mapping  # the step's, as vLLM's runner set it (None before vLLM's first step)
        self._models.set_adapter_mapping(LoRAMapping(tokens, tuple(ids), is_prefill=True))
        try:
            yield
        finally:
            if step is not None:
                self._models.set_adapter_mapping(step)

    def _activate(self, adapter: Adapter) -> str:
        """Put `adapter` in a GPU slot unless another must leave for it; why not ("" once it is there)."""
        models = self._models
        slots: list[int | None] = models.lora_index_to_id
        if adapter.lora_id in slots:
            return ""
        if None not in slots:
            return f"all {len(slots)} of vLLM's LoRA slots hold other adapters"
        if models.get_adapter(adapter.lora_id) is not None:
            models.activate_adapter(adapter.lora_id)
            return ""
        if len(models) >= models.capacity:
            return f"vLLM's CPU LoRA cache is full ({models.capacity} adapters)"
        from vllm.lora.request import LoRARequest

        self._worker.add_adapter(LoRARequest(adapter.name, adapter.lora_id, adapter.path))  # loads, activates
        return ""

    def _has_embeddings(self, lora_id: int) -> bool:
        from vllm.lora.layers import VocabParallelEmbeddingWithLoRA

        model = self._models.get_adapter(lora_id)
        return any(isinstance(self._models.modules.get(name), VocabParallelEmbeddingWithLoRA)
                   for name in (model.loras if model is not None else ()))
