"""Chunk keys, the chunk object format and int8 quantization."""
