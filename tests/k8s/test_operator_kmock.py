"""The kopf operator end to end against kmock (see kmock_env.py: a fake API, because no real API server
can run here): create, spec updates, status from the workloads' readiness, idempotency, deletion.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from cacheflow_operator.spec import API_VERSION, KIND, PLURAL
from tests.k8s.kmock_env import CR_PATH, NAMESPACE, Api, child_path, cluster_body, running_operator

pytestmark = pytest.mark.asyncio

TINY = {"model": {"source": "tiny", "layers": 8}, "stages": {"count": 2}, "storage": {"pods": 2}}
WORKLOADS = [("apps/v1", "deployments", "demo-coordinator"), ("apps/v1", "deployments", "demo-stage-0"),
             ("apps/v1", "deployments", "demo-stage-1"), ("apps/v1", "statefulsets", "demo-storage")]
CHILDREN = [("v1", "configmaps", "demo-spec"), ("v1", "services", "demo-storage"), ("v1", "services", "demo-stage-0"),
            ("v1", "services", "demo-stage-1"), ("v1", "services", "demo-coordinator"), *WORKLOADS]


def stored_cluster(server: Any) -> dict[str, Any]:
    """The resource as the fake API holds it (read without going through HTTP)."""
    stored: dict[str, Any] = server.objects[f"{API_VERSION}/{PLURAL}", NAMESPACE, "demo"].raw
    return stored


def condition(cr: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    conditions = ((cr or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


async def wait_condition(api: Api, kind: str, status: str, *, generation: int | None = None) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        cr = await api.cluster()
        ok = condition(cr, kind).get("status") == status
        observed = generation is None or (cr or {}).get("status", {}).get("observedGeneration") == generation
        return cr if ok and observed else None

    result: dict[str, Any] = await api.eventually(probe)
    return result


async def create_and_wait(api: Api, spec: dict[str, Any] = TINY) -> dict[str, Any]:
    await api.call("POST", CR_PATH, cluster_body(spec))
    return await wait_condition(api, "Progressing", "True", generation=1)


async def test_create_builds_owned_children_and_reports_progress(kmock, tmp_path, monkeypatch):
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        cr = await create_and_wait(api)
        for api_version, plural, name in CHILDREN:
            obj = await api.get(child_path(api_version, plural, name))
            assert obj is not None, f"{plural}/{name} was not created"
            # kmock collects no garbage: what makes Kubernetes delete the children with the resource is this
            assert obj["metadata"]["ownerReferences"] == [{"apiVersion": API_VERSION, "kind": KIND, "name": "demo",
                                                           "uid": "uid-demo", "controller": True,
                                                           "blockOwnerDeletion": True}]
        worker = await api.get(child_path("apps/v1", "deployments", "demo-stage-1"))
        assert worker is not None
        args = worker["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[:5] == ["worker", "--stage", "1", "--layers", "4:8"]
        assert cr["status"]["layerSplit"] == "0:4,4:8"
        assert condition(cr, "Ready")["status"] == "False" and condition(cr, "Degraded")["status"] == "False"
        assert not cr["metadata"].get("finalizers"), "no delete handler, so nothing should hold deletion up"


async def test_status_follows_the_workloads_readiness(kmock, tmp_path, monkeypatch):
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        for workload in WORKLOADS:
            await api.mark_ready(*workload)
        cr = await wait_condition(api, "Ready", "True")
        assert condition(cr, "Progressing")["status"] == "False" and condition(cr, "Degraded")["status"] == "False"
        ready_since = condition(cr, "Ready")["lastTransitionTime"]

        # a storage pod dies (no rollout going on): Degraded, and it stays so until the pod is back
        path = child_path("apps/v1", "statefulsets", "demo-storage") + "/status"
        await api.call("PATCH", path, {"status": {"readyReplicas": 1}})
        cr = await wait_condition(api, "Degraded", "True")
        assert condition(cr, "Ready")["status"] == "False"
        assert "storage: 1/2 ready" in condition(cr, "Degraded")["message"]
        await api.call("PATCH", path, {"status": {"readyReplicas": 2}})
        cr = await wait_condition(api, "Ready", "True")
        assert condition(cr, "Degraded")["status"] == "False"
        assert condition(cr, "Ready")["lastTransitionTime"] >= ready_since


async def test_spec_updates_scale_stages_and_storage(kmock, tmp_path, monkeypatch):
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        # the API server bumps metadata.generation on a spec change; kmock does not, so the test does
        patch = {"metadata": {"generation": 2}, "spec": {"stages": {"count": 4}, "storage": {"pods": 3}}}
        await api.call("PATCH", f"{CR_PATH}/demo", patch)
        cr = await wait_condition(api, "Progressing", "True", generation=2)
        assert cr["status"]["layerSplit"] == "0:2,2:4,4:6,6:8"
        sts = await api.get(child_path("apps/v1", "statefulsets", "demo-storage"))
        assert sts is not None and sts["spec"]["replicas"] == 3
        stage3 = await api.get(child_path("apps/v1", "deployments", "demo-stage-3"))
        assert stage3 is not None
        args = stage3["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--pods") + 1].count("=") == 3 and "--next-stage" not in args
        stage2 = await api.get(child_path("apps/v1", "deployments", "demo-stage-2"))
        assert stage2 is not None
        args = stage2["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--next-stage") + 1] == "http://demo-stage-3.ml.svc:7500"

        await api.call("PATCH", f"{CR_PATH}/demo", {"metadata": {"generation": 3}, "spec": {"stages": {"count": 1}}})
        await wait_condition(api, "Progressing", "True", generation=3)
        for stage in (1, 2, 3):  # the removed stages' workloads and Services are deleted
            assert await api.get(child_path("apps/v1", "deployments", f"demo-stage-{stage}")) is None
            assert await api.get(child_path("v1", "services", f"demo-stage-{stage}")) is None
        stage0 = await api.get(child_path("apps/v1", "deployments", "demo-stage-0"))
        assert stage0 is not None
        args = stage0["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--layers") + 1] == "0:8" and "--next-stage" not in args


async def test_reconciling_again_changes_nothing(kmock, tmp_path, monkeypatch, caplog):
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        for workload in WORKLOADS:
            await api.mark_ready(*workload)
        await wait_condition(api, "Ready", "True")
        writes = api.child_writes()
        assert len([w for w in writes if w.startswith("POST")]) == len(CHILDREN)
    cr_before = stored_cluster(kmock)
    requests_before = len(kmock)
    caplog.clear()
    caplog.set_level(logging.INFO, logger="kopf.objects")
    # a restarted operator resumes every resource: it reconciles it again, and nothing needs to change
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        async def resumed() -> bool:
            return any(r.getMessage() == "Resuming is processed: 1 succeeded; 0 failed." for r in caplog.records)

        await api.eventually(resumed)
        await api.settled()
        writes_now = [f"{r.method.value} {r.url.path}" for r in list(kmock)[requests_before:]
                      if r.method.value != "GET"]
        assert writes_now == [], "reconciling an unchanged resource wrote to the API"
        assert stored_cluster(kmock) == cr_before


async def test_deletion_leaves_the_children_to_the_garbage_collector(kmock, tmp_path, monkeypatch):
    """kmock has no garbage collector: the children stay in it after the resource is gone. What this
    shows is the operator's side: no finalizer holds the deletion up, the children all name the
    resource as their controlling owner (the real collector deletes them by that), and the operator
    neither recreates nor touches them once their owner is gone."""
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        await api.settled()  # a reconcile still running when the owner goes may create a child (the GC gets it)
        await api.call("DELETE", f"{CR_PATH}/demo")
        assert await api.cluster() is None, "deletion was held up"
        writes = api.child_writes()
        # a workload changes after its owner is gone: the operator must not recreate or patch anything
        await api.mark_ready("apps/v1", "deployments", "demo-coordinator")
        await api.call("DELETE", child_path("apps/v1", "deployments", "demo-stage-0"))
        await api.settled()
        assert api.child_writes() == [*writes, "PATCH /apis/apps/v1/namespaces/ml/deployments/demo-coordinator/status",
                                      "DELETE /apis/apps/v1/namespaces/ml/deployments/demo-stage-0"]
        assert await api.get(child_path("apps/v1", "deployments", "demo-stage-0")) is None


async def test_a_deleted_child_is_recreated(kmock, tmp_path, monkeypatch):
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        await api.call("DELETE", child_path("apps/v1", "deployments", "demo-stage-0"))
        recreated = await api.eventually(lambda: api.get(child_path("apps/v1", "deployments", "demo-stage-0")))
        assert recreated["spec"]["template"]["spec"]["containers"][0]["args"][:3] == ["worker", "--stage", "0"]


async def test_an_invalid_spec_is_reported_and_builds_nothing(kmock, tmp_path, monkeypatch):
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        spec = {"model": {"source": "tiny", "layers": 8}, "stages": {"count": 3, "layerSplit": "0:4,4:8"}}
        await api.call("POST", CR_PATH, cluster_body(spec))
        cr = await wait_condition(api, "Degraded", "True")
        assert condition(cr, "Degraded")["reason"] == "InvalidSpec"
        assert "has 2 stages, stages.count is 3" in condition(cr, "Degraded")["message"]
        assert condition(cr, "Ready")["status"] == "False"
        assert api.child_writes() == []


async def test_a_child_the_api_refuses_is_reported(kmock, tmp_path, monkeypatch):
    refusal = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 403, "reason": "Forbidden",
               "message": 'statefulsets.apps is forbidden: exceeded quota "storage"'}
    kmock[f"post {child_path('apps/v1', 'statefulsets')}"] << 403 << refusal
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await api.call("POST", CR_PATH, cluster_body(TINY))
        cr = await wait_condition(api, "Degraded", "True")
        degraded = condition(cr, "Degraded")
        assert degraded["reason"] == "ApplyFailed"
        assert "403" in degraded["message"] and "exceeded quota" in degraded["message"]
        assert condition(cr, "Ready")["status"] == "False"
