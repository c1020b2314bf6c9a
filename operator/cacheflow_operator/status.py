"""The resource's status from its workloads' readiness: conditions Ready, Progressing and Degraded.

* Ready: every workload (coordinator, each stage, the storage pods) has all its replicas ready and updated.
* Progressing: not ready yet while a rollout (creation, a spec change, pods starting) goes on.
* Degraded: a workload failed its rollout (progress deadline exceeded, replica failure), or the
  cluster was ready (or degraded) and lost replicas without a rollout (a crashed pod, a lost node);
  also an invalid spec, or children the API refused. It stays so until the cluster is ready again.

A condition's lastTransitionTime moves only when its status changes, so recomputing an unchanged
cluster yields the same status (and no patch).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

from cacheflow_operator.manifests import common
from cacheflow_operator.spec import Cluster


@dataclass(frozen=True)
class Workload:
    name: str
    desired: int
    ready: int
    rolling: bool  # created but not yet observed, or replicas not yet updated to the current template
    failed: str  # why its rollout failed ("" if it did not)

    @property
    def ok(self) -> bool:
        return self.ready >= self.desired and not self.rolling

    @classmethod
    def of(cls, name: str, obj: dict[str, Any] | None) -> Workload:
        if obj is None:
            return cls(name, 1, 0, True, "")
        spec, status, meta = obj.get("spec", {}), obj.get("status") or {}, obj.get("metadata", {})
        desired = int(spec.get("replicas", 1))
        observed = int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 0)
        rolling = not observed or int(status.get("updatedReplicas") or 0) < desired
        return cls(name, desired, int(status.get("readyReplicas") or 0), rolling, _failure(status))


def _failure(status: dict[str, Any]) -> str:
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return cond.get("message") or "progress deadline exceeded"
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return cond.get("message") or "replica failure"
    return ""


def workload_refs(c: Cluster) -> list[tuple[str, str, str]]:
    """(kind, name, label) of each workload whose readiness makes the cluster's."""
    return [("Deployment", common.coordinator_name(c), "coordinator"),
            *(("Deployment", common.stage_name(c, s), f"stage {s}") for s in range(c.spec.stages.count)),
            ("StatefulSet", common.storage_name(c), "storage")]


def _condition(kind: str, on: bool, reason: str, message: str, previous: dict[str, dict[str, Any]],
               generation: int, now: str) -> dict[str, Any]:
    status = "True" if on else "False"
    before = previous.get(kind, {})
    since = before["lastTransitionTime"] if before.get("status") == status and "lastTransitionTime" in before else now
    return {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": since,
            "observedGeneration": generation}


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def conditions(workloads: list[Workload], previous: list[dict[str, Any]], generation: int,
               now: str) -> list[dict[str, Any]]:
    before = {c.get("type", ""): c for c in previous}
    waiting = [w for w in workloads if not w.ok]
    failed = [w for w in workloads if w.failed]
    ready = not waiting
    was = {k for k in ("Ready", "Degraded") if before.get(k, {}).get("status") == "True"}
    lost = not ready and was and not any(w.rolling for w in workloads)
    degraded = bool(failed) or bool(lost)
    summary = ", ".join(f"{w.name}: {w.ready}/{w.desired} ready{' (rolling out)' if w.rolling else ''}"
                        for w in waiting)
    why = "; ".join(f"{w.name}: {w.failed}" for w in failed) or summary
    return [
        _condition("Ready", ready, "AllReady" if ready else "NotReady", summary or "all workloads ready",
                   before, generation, now),
        _condition("Progressing", not ready and not degraded, "RollingOut" if waiting and not degraded else "Idle",
                   summary if not degraded else "", before, generation, now),
        _condition("Degraded", degraded, ("RolloutFailed" if failed else "LostReplicas") if degraded else "Healthy",
                   why if degraded else "", before, generation, now),
    ]


SPEC_FAILURES = ("InvalidSpec", "ApplyFailed")  # reasons only a successful reconcile clears


def spec_failed(previous: list[dict[str, Any]]) -> bool:
    return any(c.get("type") == "Degraded" and c.get("reason") in SPEC_FAILURES for c in previous)


def failed_conditions(reason: str, message: str, previous: list[dict[str, Any]], generation: int, now: str
                      ) -> list[dict[str, Any]]:
    """The spec cannot be carried out: `InvalidSpec` (the operator refuses it) or `ApplyFailed` (the API did)."""
    before = {c.get("type", ""): c for c in previous}
    return [_condition("Ready", False, reason, message, before, generation, now),
            _condition("Progressing", False, reason, "", before, generation, now),
            _condition("Degraded", True, reason, message, before, generation, now)]
