"""CacheFlow core library: model runtime, chunk format, stores and restore executors.

This package imports no web framework and never imports `cacheflow_services`.
"""
