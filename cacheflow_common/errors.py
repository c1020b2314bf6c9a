"""The error tree: every error CacheFlow raises on purpose derives from `CacheFlowError`.

A missing or corrupt chunk is not an error: it is a miss, returned as a value and recomputed.
"""


class CacheFlowError(Exception):
    """Base of every error CacheFlow raises on purpose."""


class ConfigError(CacheFlowError):
    """A configuration (model config, cluster spec, profile) is invalid or unsupported."""


class BadRequestError(CacheFlowError):
    """Input from a caller is invalid; the message says why (maps to HTTP 4xx)."""


class ChunkFormatError(CacheFlowError):
    """Bytes do not form a valid chunk (bad magic, truncated, header mismatch)."""


class StoreError(CacheFlowError):
    """A store could not complete a write (a failed read is a miss, not an error)."""


class UnauthorizedError(ConfigError):
    """A service refused our credentials (a wrong or missing bearer token is a deployment mistake)."""


class GrantError(UnauthorizedError):
    """A call to a worker without a valid grant from the coordinator for what it asks (HTTP 403)."""
