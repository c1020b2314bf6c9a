"""CacheFlow core library: model runtime, chunk format, stores and the restore engine.

This package imports no web framework and never imports `cacheflow_services`.
"""
