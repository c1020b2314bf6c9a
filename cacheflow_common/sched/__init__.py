"""Batch-aware restore scheduling (Algorithm 1 of the paper) as pure policy: no threads, no clock, no I/O.

The same `BatchScheduler` drives the workers and the discrete-event simulator (`cacheflow_common.sim`).
"""

from cacheflow_common.sched.plan import NOT_STORED, RequestPlan, StagePlan, build_plan
from cacheflow_common.sched.policies import POLICIES, Policy, choose_mode, make_policy
from cacheflow_common.sched.scheduler import BatchScheduler, ComputeTask, LoadTask

__all__ = [
    "NOT_STORED",
    "POLICIES",
    "BatchScheduler",
    "ComputeTask",
    "LoadTask",
    "Policy",
    "RequestPlan",
    "StagePlan",
    "build_plan",
    "choose_mode",
    "make_policy",
]
