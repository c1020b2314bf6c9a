"""Pure builders: a parsed CacheFlowCluster in, Kubernetes manifests (plain dicts) out.

The operator applies what `build.children` returns; the tests validate the same dicts offline.
"""
