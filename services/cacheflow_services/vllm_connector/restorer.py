"""The connector's restore engine: `cacheflow_common.engine.Engine` as a one-stage engine over its vLLM
rank's layers — all of them, fed by the token embeddings, or (a pipeline-parallel rank after the first)
[a, b), fed by the stored boundary activations entering layer a. One compute loop runs one batched
forward per step over every request's units, one loader per storage pod: a step's loads restore together
(`batch_restores`), or one by one, with the same policies and channel ranking as a stage worker's.
"""

from __future__ import annotations

from cacheflow_common.engine import EngineSettings
from cacheflow_common.restore.profile import Profile
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_services.vllm_connector.config import ConnectorConfig

PREFILL_TOKENS = 2048  # compute-only's unit with vLLM's attention kernel (the engine's default)


def engine_settings(cfg: ConnectorConfig, layers: range, profile: Profile | None, link: float | None,
                    policy: str, *, num_layers: int, paged_attention: bool, token_only: bool = False
                    ) -> EngineSettings:
    """The connector's settings as a one-stage engine's over the rank's layers (stage 1 stands for any rank
    after the first: its restores read boundary activations; a rank holding fewer than the model's
    `num_layers` is one pipeline stage of several, and picks its mode as a stage worker does). `link`:
    bytes/s of a pod's link, if known.

    Compute-only recomputes in units of the engine's prefill size where restores attend with vLLM's CPU
    kernel over the blocks (`paged_attention`): 0.892 s against 0.953 s in 256-token chunks at 4,096 tokens
    (2 CPU cores); with torch's SDPA and its explicit causal mask, in storage chunks (a 2,048-token unit took
    0.98 s against 0.67 s in 256-token chunks). `token_only`: never layer-wise (an L_delta of 0)."""
    return EngineSettings(layers=layers, stage=int(layers.start > 0), pipeline=layers != range(num_layers),
                          policy=policy, chunk_size=cfg.chunk_size,
                          prefill_tokens=PREFILL_TOKENS if paged_attention else cfg.chunk_size,
                          channels=tuple(PodAddress.parse(p).pod_id for p in cfg.pods),
                          costs=profile.cost_model(link) if profile else None,
                          l_delta=profile.l_delta_for(link) if profile and not token_only else 0)
