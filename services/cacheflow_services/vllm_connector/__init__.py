"""CacheFlow as a vLLM v1 KV connector: vLLM instances save their prompts' KV to CacheFlow's storage pods and
restore cached prefixes with CacheFlow's two-pointer method.

Enable it in vLLM with `kv_connector_module_path="cacheflow_services.vllm_connector.connector"` (see the
README's "vLLM connector" section). Only `connector.py` imports vLLM; the rest is plain CacheFlow code.
"""
