"""The one two-pointer restore engine (docs/architecture.md, "The engine"): `Engine` for a stage's batch,
`restore()` for one request. What other packages use of it is here; its other modules are its internals."""

from cacheflow_common.engine.builder import UPSTREAM_FED
from cacheflow_common.engine.core import RestoreCancelledError
from cacheflow_common.engine.engine import Engine, as_result
from cacheflow_common.engine.library import restore
from cacheflow_common.engine.settings import EngineSettings
from cacheflow_common.engine.stage_restore import StageRestore
from cacheflow_common.engine.step_plan import ForwardItem, StepPlan
from cacheflow_common.restore.job import ChunkComputed, RestoreJob, RestoreResult, UnitRecord

__all__ = ["UPSTREAM_FED", "ChunkComputed", "Engine", "EngineSettings", "ForwardItem", "RestoreCancelledError",
           "RestoreJob", "RestoreResult", "StageRestore", "StepPlan", "UnitRecord", "as_result", "restore"]
