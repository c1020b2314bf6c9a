"""The kopf operator end to end against kmock (see kmock_env.py: a fake API, because no real API server
can run here): create, spec updates, status from the workloads' readiness, idempotency, deletion.
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

import aiohttp
import pytest
from kmock import KubernetesEmulator, ResourceInfo

from cacheflow_common.auth import Grant, GrantSigner, GrantVerifier, new_cluster_secrets
from cacheflow_operator.kube import Ref
from cacheflow_operator.manifests.build import children
from cacheflow_operator.spec import API_VERSION, KIND, PLURAL, Cluster
from tests.k8s.kmock_env import (
    CR_PATH,
    KMOCK_CONTAINS,
    NAMESPACE,
    Api,
    ApplyingEmulator,
    child_path,
    cluster_body,
    holds,
    running_operator,
)

# the operator applies its children (server-side apply): kmock's emulator plus creation on apply (kmock_env.py)
pytestmark = [pytest.mark.asyncio, pytest.mark.kmock(cls=ApplyingEmulator)]

TINY = {"model": {"source": "tiny", "layers": 8}, "stages": {"count": 2}, "storage": {"pods": 2}}
WORKLOADS = [("apps/v1", "deployments", "demo-coordinator"), ("apps/v1", "deployments", "demo-stage-0"),
             ("apps/v1", "deployments", "demo-stage-1"), ("apps/v1", "statefulsets", "demo-storage")]
POLICIES = [("networking.k8s.io/v1", "networkpolicies", f"demo-{n}")
            for n in ("default-deny", "coordinator", "stage-0", "stage-1", "storage")]
CHILDREN = [("v1", "configmaps", "demo-spec"), ("v1", "services", "demo-storage"), ("v1", "services", "demo-stage-0"),
            ("v1", "services", "demo-stage-1"), ("v1", "services", "demo-coordinator"), *WORKLOADS, *POLICIES]
SECRET = child_path("v1", "secrets", "demo-internal")
SECRET_KEY = ("v1", "secrets", "demo-internal")
TLS_SECRET_KEY = ("v1", "secrets", "demo-tls")  # TLS on the internal hops: on by default
CHILD_KINDS = {plural for _, plural, _ in CHILDREN}


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

    # generous: a spec change is a few hundred requests to the fake API (its waits took up to ~50 s on 2 busy cores
    # before kmock_env.holds, a few seconds since); a liveness bound, not a speed check
    result: dict[str, Any] = await api.eventually(probe, timeout_s=180)
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
        assert args[args.index("--next-stage") + 1] == "https://demo-stage-3.ml.svc:7500"  # TLS: on by default

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
    """On a real API server an apply of what an object already holds writes nothing (no new resourceVersion, no
    event); kmock cannot show that (it merges every PATCH), so this checks what the operator sends: one apply per
    child and nothing else (no create, no delete, the Secret left alone), and that the objects stay as they were."""
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        for workload in WORKLOADS:
            await api.mark_ready(*workload)
        await wait_condition(api, "Ready", "True")
        created = [w for w in api.child_writes() if not w.startswith("PATCH")]
        assert created == [f"POST {child_path('v1', 'secrets')}"] * 2  # the internal and the TLS Secrets
    cr_before = stored_cluster(kmock)
    kept = [*CHILDREN, SECRET_KEY, TLS_SECRET_KEY]
    children_before = {c: kmock.objects[f"{c[0]}/{c[1]}", NAMESPACE, c[2]].raw for c in kept}
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
        assert sorted(writes_now) == sorted(f"PATCH {child_path(*c)}" for c in CHILDREN), \
            "reconciling an unchanged resource should send one apply per child and nothing else"
        assert stored_cluster(kmock) == cr_before
        assert {c: kmock.objects[f"{c[0]}/{c[1]}", NAMESPACE, c[2]].raw for c in kept} == children_before


async def test_children_are_applied_server_side(kmock, tmp_path, monkeypatch):
    """Every child is sent as a server-side apply: PATCH with the apply-patch content type, the operator's own field
    manager, force, and the whole desired object as the body. kmock does not implement apply (no managedFields, no
    removal of dropped fields, no conflicts), so the request is what can be checked here, not the API's merge."""
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        await api.settled()
    wanted = {Ref.of(o).path(): o for o in children(Cluster.from_resource(cluster_body(TINY)))}
    patches = [r for r in kmock if r.method.value == "PATCH" and r.resource is not None
               and r.resource.plural in CHILD_KINDS and not r.subresource]
    assert {r.url.path for r in patches} == set(wanted) and len(wanted) == len(CHILDREN)
    for r in patches:
        assert r.headers["Content-Type"] == "application/apply-patch+yaml", r.url.path
        assert r.params == {"fieldManager": "cacheflow-operator", "force": "true"}, r.url.path
        assert r.data == wanted[r.url.path], r.url.path
    assert not [r for r in kmock if r.method.value in ("POST", "PUT") and r.resource is not None
                and r.resource.plural in CHILD_KINDS], "children are created by apply, not POST"


def _secret_writes(kmock: Any) -> list[tuple[str, str]]:
    """(method, the Secret's name) of every write to a Secret, in order."""
    return [(r.method.value, r.name or (r.data or {}).get("metadata", {}).get("name", "")) for r in kmock
            if r.method.value != "GET" and r.resource is not None and r.resource.plural == "secrets"]


def internal_material(secret: dict[str, Any]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in secret["data"].items()}


async def test_the_internal_secret_is_created_once_and_never_replaced(kmock, tmp_path, monkeypatch):
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        secret = await api.get(SECRET)
        assert secret is not None and secret["type"] == "Opaque"
        assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"  # deleted with the cluster
        material = internal_material(secret)
        assert sorted(material) == ["grant-signing-key.pem", "grant-verify-key.pem", "internal-token"]
        assert len(material["internal-token"]) >= 32
        # the two keys are one pair: what the coordinator's key signs, the workers' key verifies
        grant = Grant(op="forward", stages=(0,), request_id="r1", tenant="t", digest="", nonce="n", save=True,
                      max_tokens=8, expires_at=time.time() + 60, pod_credential="")
        signed = GrantSigner(material["grant-signing-key.pem"]).sign(grant)
        assert GrantVerifier(material["grant-verify-key.pem"]).verify(signed) == grant
        # a spec change reconciles again: the Secret stays as it is
        await api.call("PATCH", f"{CR_PATH}/demo", {"metadata": {"generation": 2}, "spec": {"stages": {"count": 3}}})
        await wait_condition(api, "Progressing", "True", generation=2)
        await api.settled()
    async with running_operator(kmock, tmp_path, monkeypatch) as api:  # and so does an operator restart
        await api.settled(2.0)
        assert internal_material(await api.get(SECRET) or {}) == material
    assert _secret_writes(kmock) == [("POST", "demo-internal"), ("POST", "demo-tls")]  # each created once


async def test_an_existing_internal_secret_is_kept(kmock, tmp_path, monkeypatch):
    """One that is already there (an earlier operator's, or restored from a backup) is used as it is."""
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        mine = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "demo-internal", "namespace": NAMESPACE},
                "data": {k: base64.b64encode(v).decode() for k, v in new_cluster_secrets().items()}}
        await api.call("POST", child_path("v1", "secrets"), mine)
        await create_and_wait(api)
        await api.settled()
        assert (await api.get(SECRET) or {}).get("data") == mine["data"]
        assert _secret_writes(kmock) == [("POST", "demo-internal"), ("POST", "demo-tls")]  # the test's own, and TLS


async def test_workers_get_the_internal_secret_not_the_pod_tokens(kmock, tmp_path, monkeypatch):
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        worker = await api.get(child_path("apps/v1", "deployments", "demo-stage-0"))
        assert worker is not None
        pod = worker["spec"]["template"]["spec"]
        assert [v["secret"] for v in pod["volumes"] if "secret" in v] == [
            {"secretName": "demo-internal", "defaultMode": 0o440,
             "items": [{"key": "internal-token", "path": "internal-token"},
                       {"key": "grant-verify-key.pem", "path": "grant-verify-key.pem"}]},
            {"secretName": "demo-tls", "defaultMode": 0o440,  # its certificate: no tenant's token either
             "items": [{"key": k, "path": k} for k in ("ca.crt", "tls.crt", "tls.key")]}]
        args = pod["containers"][0]["args"]
        assert args[args.index("--host") + 1] == "$(POD_IP)" and "--pod-token-file" not in args


async def test_turning_network_policies_off_deletes_them(kmock, tmp_path, monkeypatch):
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        assert all([await api.get(child_path(*p)) for p in POLICIES])
        patch = {"metadata": {"generation": 2}, "spec": {"networkPolicy": {"enabled": False}}}
        await api.call("PATCH", f"{CR_PATH}/demo", patch)
        await wait_condition(api, "Progressing", "True", generation=2)
        for p in POLICIES:
            assert await api.get(child_path(*p)) is None, p


async def test_a_deleted_network_policy_is_recreated(kmock, tmp_path, monkeypatch):
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
        path = child_path(*POLICIES[0])  # the default-deny
        before = await api.get(path)
        await api.call("DELETE", path)
        recreated = await api.eventually(lambda: api.get(path))
        assert before is not None and recreated["spec"] == before["spec"]


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
    kmock[f"patch {child_path('apps/v1', 'statefulsets', 'demo-storage')}"] << 403 << refusal
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await api.call("POST", CR_PATH, cluster_body(TINY))
        cr = await wait_condition(api, "Degraded", "True")
        degraded = condition(cr, "Degraded")
        assert degraded["reason"] == "ApplyFailed"
        assert "403" in degraded["message"] and "exceeded quota" in degraded["message"]
        assert condition(cr, "Ready")["status"] == "False"


@pytest.mark.kmock(cls=KubernetesEmulator)  # the plain emulator (the closest marker wins)
async def test_kmock_does_not_create_on_apply(kmock):
    """Why kmock_env's ApplyingEmulator exists: plain kmock answers an apply to a missing object with 404 (a real
    API server creates it). Should a kmock release implement apply, this fails and the emulation can go."""
    assert type(kmock) is KubernetesEmulator
    kmock.resources["v1/configmaps"] = ResourceInfo(kind="ConfigMap", namespaced=True, verbs={"get", "patch"})
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": NAMESPACE}}
    async with aiohttp.ClientSession(base_url=str(kmock.url)) as session, \
            session.patch(child_path("v1", "configmaps", "x"), json=body,
                          params={"fieldManager": "cacheflow-operator", "force": "true"},
                          headers={"Content-Type": "application/apply-patch+yaml"}) as response:
        assert response.status == 404


async def test_the_fast_membership_check_answers_as_kmocks_scan(kmock, tmp_path, monkeypatch):
    """kmock_env.holds decides from a request alone whether a reaction's view holds it (kmock scans its whole history
    for that): over every request of a reconcile, for each reaction kmock holds (its own and a test's), the answer of
    kmock's scan; a view it cannot decide (a slice) is left to that scan."""
    kmock[f"patch {child_path('v1', 'configmaps', 'never-sent')}"] << 403
    async with running_operator(kmock, tmp_path, monkeypatch) as api:
        await create_and_wait(api)
    requests, views = list(kmock), [payload._source for payload in kmock._payloads]
    answers = [(holds(view, r), KMOCK_CONTAINS(view, r)) for view in views for r in requests]
    assert all(fast == scanned for fast, scanned in answers) and {fast for fast, _ in answers} == {True, False}
    assert holds(kmock["get"][:3], requests[0]) is None
