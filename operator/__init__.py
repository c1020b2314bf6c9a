"""CacheFlow Kubernetes operator (kopf). Not built yet: see the Kubernetes issue."""
