"""The one two-pointer restore engine (docs/architecture.md, "The engine"): `RestoreEngine` for a stage's
batch, `restore()` for one request."""

from cacheflow_common.engine.engine import RestoreEngine, as_result
from cacheflow_common.engine.library import restore
from cacheflow_common.engine.settings import EngineSettings
from cacheflow_common.restore.job import ChunkComputed, RestoreJob, RestoreResult, UnitRecord

__all__ = ["ChunkComputed", "EngineSettings", "RestoreEngine", "RestoreJob", "RestoreResult", "UnitRecord",
           "as_result", "restore"]
