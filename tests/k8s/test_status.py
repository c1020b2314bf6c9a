"""Conditions Ready, Progressing and Degraded from the workloads' readiness (pure)."""

from __future__ import annotations

from cacheflow_operator.status import Workload, conditions, failed_conditions

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:05:00Z"


def deployment(replicas=1, ready=0, updated=None, generation=2, observed=2, conditions=()):
    return {"metadata": {"generation": generation}, "spec": {"replicas": replicas},
            "status": {"readyReplicas": ready, "updatedReplicas": replicas if updated is None else updated,
                       "observedGeneration": observed, "conditions": list(conditions)}}


def states(result):
    return {c["type"]: (c["status"], c["reason"]) for c in result}


def test_starting_is_progressing_then_ready():
    starting = [Workload.of("coordinator", deployment(ready=0)), Workload.of("storage", None)]
    result = conditions(starting, [], 1, T0)
    assert states(result) == {"Ready": ("False", "NotReady"), "Progressing": ("True", "RollingOut"),
                              "Degraded": ("False", "Healthy")}
    assert "storage: 0/1 ready (rolling out)" in result[0]["message"]
    ready = conditions([Workload.of("coordinator", deployment(ready=1))], result, 1, T1)
    assert states(ready) == {"Ready": ("True", "AllReady"), "Progressing": ("False", "Idle"),
                             "Degraded": ("False", "Healthy")}
    times = {c["type"]: c["lastTransitionTime"] for c in ready}
    assert times == {"Ready": T1, "Progressing": T1, "Degraded": T0}  # Degraded never changed


def test_a_rollout_is_not_ready_until_observed_and_updated():
    assert not Workload.of("w", deployment(ready=1, observed=1)).ok  # the controller has not seen the new spec
    assert not Workload.of("w", deployment(replicas=2, ready=2, updated=1)).ok  # one pod still old
    assert Workload.of("w", deployment(replicas=2, ready=2)).ok


def test_losing_replicas_without_a_rollout_is_degraded_until_ready_again():
    ready = conditions([Workload.of("storage", deployment(replicas=2, ready=2))], [], 1, T0)
    lost = conditions([Workload.of("storage", deployment(replicas=2, ready=1))], ready, 1, T1)
    assert states(lost)["Degraded"] == ("True", "LostReplicas") and states(lost)["Ready"][0] == "False"
    still = conditions([Workload.of("storage", deployment(replicas=2, ready=1))], lost, 1, T1)
    assert states(still)["Degraded"] == ("True", "LostReplicas")  # sticky, not flapping to Progressing
    rolling = conditions([Workload.of("storage", deployment(replicas=3, ready=1, updated=2))], still, 2, T1)
    assert states(rolling)["Progressing"] == ("True", "RollingOut") and states(rolling)["Degraded"][0] == "False"


def test_a_failed_rollout_is_degraded():
    stuck = deployment(ready=0, conditions=[{"type": "Progressing", "status": "False",
                                             "reason": "ProgressDeadlineExceeded", "message": "too slow"}])
    result = conditions([Workload.of("stage 1", stuck)], [], 1, T0)
    assert states(result)["Degraded"] == ("True", "RolloutFailed")
    assert result[2]["message"] == "stage 1: too slow"


def test_an_invalid_spec():
    result = failed_conditions("InvalidSpec", "bad split", [], 3, T0)
    assert states(result) == {"Ready": ("False", "InvalidSpec"), "Progressing": ("False", "InvalidSpec"),
                              "Degraded": ("True", "InvalidSpec")}
    assert all(c["observedGeneration"] == 3 for c in result)
