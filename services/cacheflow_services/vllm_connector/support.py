"""What the connector can serve, decided before it does anything: a vLLM configuration it cannot restore
correctly makes it step aside (vLLM starts and serves as without it, and says why once), and a request it
cannot restore is declined (vLLM computes it, and the request's KV is neither restored nor stored).

Both sides of the connector (vLLM's scheduler and every worker) decide from the same `VllmConfig`, so they
agree without talking. Refused, whatever recomputes the restore's front:

* a KV cache in a dtype other than the model's or fp8 (with CacheFlow's runtime: any but the model's), or with
  layers left out of its quantization (`kv_cache_dtype_skip_layers`);
* decode- or prefill-context parallelism (a rank's cache holds a slice of the tokens); tensor parallelism
  with CacheFlow's runtime (with vLLM's model a rank restores its slice of the heads: `planned_split.py`);
* speculative decoding with another draft that has KV of its own (DFlash, MTP layers with proposers of their
  own: chunks hold the target model's layers only); drafts without attention layers are served
  (`KV_FREE_DRAFTS`: n-gram and suffix lookups over the tokens, Medusa and MLP heads over the target's last
  hidden state), and so are EAGLE and EAGLE-3 drafts, MTP layers and draft models with vLLM's model, without
  pipeline parallelism (`restores_draft`: their KV is recomputed, an EAGLE or MTP draft's from the target's
  stored rows, a draft model's from the tokens, under LoRA too: `draft.py`);
* a cache of other than full-attention blocks: several groups (hybrid models: one block table per group),
  sliding-window blocks (dropped outside the window), state caches.

With vLLM's own model (`runtime: "vllm"`, the default), also multi-head latent attention, M-RoPE positions
and encoder-decoder models; with CacheFlow's runtime (`runtime: "cacheflow"`, and pipeline ranks), any model
it does not implement and quantized weights (it would read them without their scales).

A request's chunks are keyed by what its KV depends on beyond the model and the prompt tokens
(`request_keying`): its LoRA adapter (by the adapter's files) and its `cache_salt` salt its keys, so it never
shares chunks with another adapter, the base model or another salt. With vLLM's model, a LoRA request's
front is recomputed under its adapter (`adapters.py`); with CacheFlow's runtime, which has no adapters, it
is restored by loads alone. Requests with prompt embeddings or multimodal inputs are declined (their KV is
not a function of the prompt tokens).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from cacheflow_common.errors import ConfigError
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.restore.boundary import BOUNDARY_KIND, OUTPUT_KIND
from cacheflow_services.vllm_connector.model_identity import FP8, adapter_fingerprint
from cacheflow_services.vllm_connector.plan import Adapter, Keying

log = logging.getLogger(__name__)
ATTENTION_SPECS = ("FullAttentionSpec",)  # caches of every position's K and V in blocks
# Speculative methods whose drafts have no KV cache: the target's cache, which chunks hold, is the whole of it.
KV_FREE_DRAFTS = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")
# Drafts whose KV a restore recomputes: EAGLE's and MTP's layers over the target's output rows, stored with the
# chunks (EAGLE-3's: the target's residual streams at its auxiliary layers); a draft model's over the tokens.
DRAFTS_FROM_OUTPUT = ("eagle", "mtp")
DRAFTS_FROM_ROWS = (*DRAFTS_FROM_OUTPUT, "eagle3")
RESTORED_DRAFTS = (*DRAFTS_FROM_ROWS, "draft_model")
# MTP layers vLLM runs with proposers of their own (Gemma 4's shares the target's KV; Step-3.5's picks a layer per
# draft step), not with its EAGLE proposer over the target's output rows
MTP_OWN_PROPOSERS = ("gemma4_mtp", "step3p5_mtp")


def model_dir(model: str, revision: str | None = None) -> Path:
    """The local directory of `model`: itself, or a Hugging Face Hub id resolved in the local cache, where
    vLLM downloaded it before the connector starts (never downloads)."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=model, revision=revision, local_files_only=True))
    except Exception as exc:  # not a Hub id, or not in the local cache
        raise ConfigError(f"the model {model!r} is neither a directory nor a Hub id in the local cache "
                          f"({type(exc).__name__}: {exc}); set the connector's `model` to its directory") from exc


def unsupported(vllm_config: Any, model: str, runtime: str) -> str:
    """Why the connector cannot serve `vllm_config` with the checkpoint at `model`, recomputing with `runtime`
    ("vllm": vLLM's own model; "cacheflow": CacheFlow's), or "" if it can."""
    parallel, cache = vllm_config.parallel_config, vllm_config.cache_config
    model_config = vllm_config.model_config
    sharded = {"decode context": parallel.decode_context_parallel_size,
               "prefill context": getattr(parallel, "prefill_context_parallel_size", 1)}
    if runtime != "vllm":
        sharded["tensor"] = parallel.tensor_parallel_size
    for kind, size in sharded.items():
        if size > 1:
            return f"{kind} parallelism ({size} ranks): a rank's cache holds a slice of the KV heads"
    if cache.cache_dtype != "auto" and (runtime != "vllm" or cache.cache_dtype not in FP8):
        return f"KV cache dtype {cache.cache_dtype}: chunks hold the model's dtype or (with vLLM's model) fp8"
    if cache.cache_dtype != "auto" and getattr(cache, "kv_cache_dtype_skip_layers", None):
        return "layers left out of the KV cache's quantization: chunks hold one dtype"
    if (reason := _unsupported_draft(vllm_config, runtime)):
        return reason
    if runtime == "vllm":
        return _unsupported_by_vllm_runtime(model_config)
    if model_config.quantization:
        return f"{model_config.quantization} quantized weights: CacheFlow's runtime recomputes unquantized weights only"
    try:
        ModelConfig.from_dir(model)
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        return f"CacheFlow's runtime cannot read this model: {exc}"
    return ""


def restores_draft(vllm_config: Any) -> str:
    """The method of the draft whose KV restores also recompute ("eagle", "eagle3", "mtp", "draft_model"; ""
    for none)."""
    draft = vllm_config.speculative_config
    return str(draft.method) if draft is not None and draft.method in RESTORED_DRAFTS else ""


def draft_reads_rows(vllm_config: Any) -> bool:
    """Whether the draft whose KV restores recompute reads the target's rows (an EAGLE or MTP draft's: captured
    and stored with the chunks), not the tokens alone (a draft model)."""
    return restores_draft(vllm_config) in DRAFTS_FROM_ROWS


def draft_reads_output(vllm_config: Any) -> bool:
    """Whether that draft reads the target's output rows (EAGLE, MTP), stored at one known place with the
    chunks (EAGLE-3's rows are at layers the model chooses)."""
    return restores_draft(vllm_config) in DRAFTS_FROM_OUTPUT


def draft_sources(vllm_config: Any, num_layers: int) -> list[tuple[int, str]]:
    """The rows, as stored beside each chunk (layer, kind), that the draft whose KV restores rerun reads: an
    EAGLE or MTP draft's the model's output rows, at its layer count; an EAGLE-3 draft's the boundary
    activations entering its auxiliary layers; a draft model's none."""
    if draft_reads_output(vllm_config):
        return [(num_layers, OUTPUT_KIND)]
    if restores_draft(vllm_config) == "eagle3":
        return [(layer, BOUNDARY_KIND) for layer in eagle3_aux_layers(vllm_config, num_layers)]
    return []


def eagle3_aux_layers(vllm_config: Any, num_layers: int) -> tuple[int, ...]:
    """The layers whose entering residual streams an EAGLE-3 draft reads, in order, as vLLM 0.32's runner picks
    them (`_setup_eagle3_aux_hidden_state_outputs`): the draft config's `eagle_aux_hidden_state_layer_ids` (or
    its `eagle_config`'s), else the model's default, (2, L // 2, L - 3) but for the few model classes that
    override it (the worker warns where the model picks others: `WorkerEngine._check_aux_layers`)."""
    hf_config = getattr(getattr(vllm_config.speculative_config, "draft_model_config", None), "hf_config", None)
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None)
    eagle_config = getattr(hf_config, "eagle_config", None)
    if not ids and isinstance(eagle_config, dict):
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    return tuple(sorted(set(ids or (2, num_layers // 2, num_layers - 3))))


def _unsupported_draft(vllm_config: Any, runtime: str) -> str:
    """Why the connector cannot serve `vllm_config`'s speculative decoding ("" if it can): a draft's KV is
    either none (`KV_FREE_DRAFTS`) or an EAGLE or MTP draft's or a draft model's, which vLLM's model recomputes
    (one pipeline rank)."""
    draft = vllm_config.speculative_config
    if draft is None or draft.method in KV_FREE_DRAFTS:
        return ""
    if draft.method not in RESTORED_DRAFTS:
        return f"speculative decoding with {draft.method}: the draft's own KV is not in the chunks"
    if (mtp := _mtp_type(draft)) in MTP_OWN_PROPOSERS:
        return f"speculative decoding with {mtp} layers: vLLM feeds them with a proposer of their own, not " \
               "over the target's output rows"
    parallel = vllm_config.parallel_config
    where = {"CacheFlow's runtime": runtime != "vllm", "pipeline parallelism": parallel.pipeline_parallel_size > 1}
    for name, on in where.items():
        if on:
            return f"speculative decoding with {draft.method} under {name}: its draft's KV is recomputed with " \
                   "vLLM's model, on one pipeline rank"
    return ""


def _mtp_type(draft: Any) -> str:
    """The model type of an MTP draft's layers ("" for other drafts)."""
    config = getattr(getattr(draft, "draft_model_config", None), "hf_config", None) if draft.method == "mtp" else None
    return str(getattr(config, "model_type", "") or "")


def _unsupported_by_vllm_runtime(model_config: Any) -> str:
    """What recomputing with vLLM's own model does not cover (its caches or positions are not per-token K/V
    at consecutive positions)."""
    if model_config.use_mla:
        return "multi-head latent attention: its cache holds a latent, not per-head K and V"
    if model_config.uses_mrope:
        return "multimodal rotary positions (M-RoPE): positions are not token indices"
    if model_config.is_encoder_decoder:
        return "an encoder-decoder model"
    return ""


def unsupported_cache(kv_cache_config: Any) -> str:
    """Why the connector cannot serve vLLM's KV cache layout ("" if it can): it uses one block table."""
    groups = len(getattr(kv_cache_config, "kv_cache_groups", ()) or ())
    if groups > 1:
        return f"the KV cache is split into {groups} groups (a hybrid model): the connector reads one block table"
    for group in getattr(kv_cache_config, "kv_cache_groups", ()) or ():
        kind = type(group.kv_cache_spec).__name__
        if kind not in ATTENTION_SPECS:
            return f"a {kind} KV cache: the connector reads per-token K and V"
    return ""


def declined(request: Any) -> str:
    """Why the connector does not restore or store `request` ("" if it does)."""
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt embeddings: chunks are keyed by prompt tokens"
    if getattr(request, "mm_features", None):
        return "multimodal inputs: chunks are keyed by prompt tokens"
    return ""


def request_keying(request: Any) -> Keying:
    """How `request`'s chunks are keyed: salted by its LoRA adapter's identity and its cache_salt; its adapter
    (vLLM's name, id and path) goes with its loads, to recompute under it."""
    parts, lora, adapter = [], request.lora_request, None
    if lora is not None:
        parts.append(f"lora:{adapter_fingerprint(Path(lora.lora_path))}")
        adapter = Adapter(lora.lora_name, lora.lora_int_id, lora.lora_path)
    if request.cache_salt:
        parts.append(f"cache_salt:{request.cache_salt}")
    return Keying(salt="|".join(parts), adapter=adapter)


class OnceLog:
    """Logs each distinct reason once per process (a declined request per step must not flood the log)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def warn(self, message: str, reason: str) -> bool:
        """Log `message % reason` unless this reason was logged before; True if it was logged now."""
        if reason in self._seen:
            return False
        self._seen.add(reason)
        log.warning(message, reason)
        return True
