"""CacheFlow Kubernetes operator (kopf): reconciles CacheFlowCluster resources into workloads (`cacheflow operator`)."""
