"""Model runtime: config, KV buffer and a transformer that runs any layer range on any token range."""

from cacheflow_common.model.config import ModelConfig, MoeConfig, RopeConfig
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.model.transformer import Span, Transformer

__all__ = ["KVBuffer", "ModelConfig", "MoeConfig", "RopeConfig", "Span", "Transformer"]
