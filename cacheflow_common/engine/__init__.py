"""The one two-pointer restore engine (docs/architecture.md, "The engine"): `Engine` for a stage's batch,
`restore()` for one request, `profile_model` to measure what its costs are. What other packages use of it is
here; its other modules are its internals."""

from cacheflow_common.engine.builder import UPSTREAM_FED
from cacheflow_common.engine.core import RestoreCancelledError
from cacheflow_common.engine.engine import Engine, as_result
from cacheflow_common.engine.library import restore
from cacheflow_common.engine.pool import KVPool, PoolFullError
from cacheflow_common.engine.profiler import NEVER_TOKEN_WISE, ProfileSettings, profile_model
from cacheflow_common.engine.requests import ConflictError, RequestTable, StageRequest
from cacheflow_common.engine.settings import EngineSettings
from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.engine.step_plan import ForwardItem, StepPlan
from cacheflow_common.restore.job import ChunkComputed, RestoreJob, RestoreResult, UnitRecord

__all__ = ["NEVER_TOKEN_WISE", "UPSTREAM_FED", "ChunkComputed", "ConflictError", "Engine", "EngineSettings",
           "ForwardItem", "KVPool", "PoolFullError", "ProfileSettings", "RequestTable", "RestoreCancelledError",
           "RestoreJob", "RestoreResult", "StageRequest", "StageRestore", "StepPlan", "UnitRecord", "as_result",
           "profile_model", "restore"]
