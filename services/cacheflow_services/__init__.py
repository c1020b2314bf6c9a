"""CacheFlow services: the `cacheflow` command, and (in later issues) coordinator, worker and storage apps."""
