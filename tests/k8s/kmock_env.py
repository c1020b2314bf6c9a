"""The operator under kopf against `kmock`, an in-memory fake of the Kubernetes API served over HTTP.

No API server can run on these machines (no kube-apiserver, kind, k3s or Docker; see
docs/architecture.md, "The operator and the Helm chart"), so kmock stands in for one: it stores
objects, serves discovery, lists, watches and merge patches. It does no validation, defaulting,
generation bumps or garbage collection; the tests say where they do by hand what a real API server
or controller would (metadata.uid and generation, a workload's readiness).

Server-side apply: kmock (0.8) serves every PATCH as a merge patch of an object that exists, whatever
its content type, and answers 404 for one that does not (test_kmock_does_not_create_on_apply checks
this). A real API server creates the object on an apply; the tests' emulator does only that part:
an apply to a missing object stores the body first, and kmock's merge follows (`ApplyingEmulator`). Field ownership
(managedFields), the removal of fields an applier no longer sends, conflicts and `force` are not
emulated: the tests check the requests the operator sends, not the API server's merge.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import kmock
import yaml
from kmock._internal import dsl, rendering

from cacheflow_operator.main import operator
from cacheflow_operator.spec import API_VERSION, KIND, PLURAL

NAMESPACE = "ml"
CR_PATH = f"/apis/{API_VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
CHILD_PLURALS = {"configmaps", "services", "deployments", "statefulsets", "networkpolicies", "secrets"}
APPLY_PATCH = "application/apply-patch+yaml"
RESOURCES = {  # what a real API server's discovery would list for these kinds
    f"{API_VERSION}/{PLURAL}": ("CacheFlowCluster", True, {"status"}),
    "apps/v1/deployments": ("Deployment", True, {"status"}),
    "apps/v1/statefulsets": ("StatefulSet", True, {"status"}),
    "v1/services": ("Service", True, set()),
    "v1/configmaps": ("ConfigMap", True, set()),
    "v1/secrets": ("Secret", True, set()),
    "networking.k8s.io/v1/networkpolicies": ("NetworkPolicy", True, set()),
    "v1/events": ("Event", True, set()),
    "v1/namespaces": ("Namespace", False, set()),
}
VERBS = {"get", "list", "watch", "create", "patch", "update", "delete"}
POLL_S = 0.5  # how often a test polls the fake


def cluster_body(spec: dict[str, Any], name: str = "demo", *, uid: str = "uid-demo", generation: int = 1
                 ) -> dict[str, Any]:
    """A CacheFlowCluster as the API server would hold it: uid and generation set (kmock sets neither)."""
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid, "generation": generation},
            "spec": spec}


def child_path(api_version: str, plural: str, name: str = "") -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{NAMESPACE}/{plural}" + (f"/{name}" if name else "")


def write_kubeconfig(path: Path, server: str) -> Path:
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "kmock",
              "clusters": [{"name": "kmock", "cluster": {"server": server}}],
              "users": [{"name": "test", "user": {"token": "kmock-does-not-check-it"}}],
              "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "test"}}]}
    path.write_text(yaml.safe_dump(config))
    return path


@dataclass
class Api:
    """The test's own client of the fake API (plain HTTP, as kubectl would be)."""

    server: kmock.KubernetesEmulator
    session: aiohttp.ClientSession

    async def call(self, method: str, path: str, body: Any = None) -> dict[str, Any] | None:
        headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
        async with self.session.request(method, path, json=body, headers=headers) as r:
            if r.status == 404:
                return None
            assert r.status < 300, await r.text()
            data: dict[str, Any] = await r.json()
            return data

    async def get(self, path: str) -> dict[str, Any] | None:
        return await self.call("GET", path)

    async def cluster(self, name: str = "demo") -> dict[str, Any] | None:
        return await self.get(f"{CR_PATH}/{name}")

    async def eventually(self, probe: Callable[[], Any], *, timeout_s: float = 60.0) -> Any:
        """Poll `probe` (a coroutine function) until it returns something truthy; the event loop keeps serving."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if result := await probe():
                return result
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"not reached within {timeout_s} s: {probe}")
            await asyncio.sleep(POLL_S)

    async def settled(self, quiet_s: float = 1.0) -> None:
        """Wait until the fake has served no request for `quiet_s`: the operator has nothing left to do."""
        seen, since = len(self.server), asyncio.get_running_loop().time()
        while asyncio.get_running_loop().time() - since < quiet_s:
            await asyncio.sleep(0.1)
            if len(self.server) != seen:
                seen, since = len(self.server), asyncio.get_running_loop().time()

    def child_writes(self) -> list[str]:
        """Every create, patch or delete of a child object the fake has served so far."""
        return [f"{r.method.value} {r.url.path}" for r in self.server
                if r.method.value in ("POST", "PATCH", "PUT", "DELETE") and r.resource is not None
                and r.resource.plural in CHILD_PLURALS]

    async def mark_ready(self, api_version: str, plural: str, name: str) -> None:
        """What the workload controllers and kubelets would report once every pod is up and ready."""
        obj = await self.get(child_path(api_version, plural, name))
        assert obj is not None, f"{plural}/{name} missing"
        replicas = obj["spec"].get("replicas", 1)
        status = {"observedGeneration": obj["metadata"].get("generation", 0), "replicas": replicas,
                  "readyReplicas": replicas, "updatedReplicas": replicas, "availableReplicas": replicas}
        await self.call("PATCH", child_path(api_version, plural, name) + "/status", {"status": status})


def is_apply(request: Any) -> bool:
    """A server-side apply request (PATCH with the apply-patch content type) on a named object."""
    content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
    return bool(request.method == "PATCH" and content_type.split(";")[0].strip() == APPLY_PATCH
                and request.resource is not None and request.name and not request.subresource)


class ApplyingEmulator(kmock.KubernetesEmulator):
    """kmock's emulator, plus: an apply to a missing object creates it, as the API server does (kmock would
    answer 404). Tests select it with `pytest.mark.kmock(cls=ApplyingEmulator)`."""

    async def _handle(self, request: Any) -> Any:
        if is_apply(request):
            key = (request.resource, request.namespace, request.name)
            if key not in self.objects or self.objects[key].deleted:
                self.objects[key] = request.data
        return await super()._handle(request)


def holds(view: Any, request: Any) -> bool | None:
    """Whether kmock's `view` yields `request`, decided from the request alone where the view is a chain of
    criteria over the root that received it (a Filter passes what its criteria pass of its source's requests; a
    Priority all of them; the root its own); None for any other view (slices, groups, streams)."""
    while True:
        kind = type(view).__iter__
        if kind is dsl.Root.__iter__:
            return any(r is request for r in reversed(view._requests))  # the request just arrived: last
        if kind is dsl.Filter.__iter__:
            if not view.criteria(request):
                return False
        elif kind is not dsl.Chained.__iter__:
            return None
        view = view._source


KMOCK_CONTAINS = dsl.View.__contains__


def contains_fast(view: Any, item: Any) -> bool:
    """kmock 0.8 decides whether a reaction's view holds an arriving request by iterating the view over the
    server's whole request history, every criterion applied to every past request, for each reaction it tries: its
    CPU cost grows with the history (the scaling test: 85 s, its rate falling from ~120 to ~10 requests a second).
    `holds` decides a chain of criteria from the request alone, with the same answer; other views as kmock does."""
    if isinstance(item, rendering.Request) and (answer := holds(view, item)) is not None:
        return answer
    return KMOCK_CONTAINS(view, item)


@contextlib.asynccontextmanager
async def running_operator(server: kmock.KubernetesEmulator, tmp_path: Path,
                           monkeypatch: Any) -> AsyncIterator[Api]:
    """`cacheflow operator --namespace ml` (kopf) against the fake API, in a thread with its own event loop:
    kopf cancels every task of its loop when it stops, which must not include the fake API's."""
    for key, (kind, namespaced, subresources) in RESOURCES.items():
        server.resources[key] = kmock.ResourceInfo(kind=kind, namespaced=namespaced, verbs=VERBS,
                                                   subresources=subresources)
    assert isinstance(server, ApplyingEmulator), "the operator applies its children: mark the test kmock(cls=...)"
    monkeypatch.setattr(dsl.View, "__contains__", contains_fast)
    monkeypatch.setenv("KUBECONFIG", str(write_kubeconfig(tmp_path / "kubeconfig", str(server.url).rstrip("/"))))
    stop, ready = threading.Event(), threading.Event()
    run = functools.partial(operator, namespaces=[NAMESPACE], clusterwide=False, stop_flag=stop, ready_flag=ready)
    thread = threading.Thread(target=lambda: asyncio.run(run()), name="kopf")
    thread.start()
    async with aiohttp.ClientSession(base_url=str(server.url)) as session:
        api = Api(server, session)
        try:
            await api.eventually(lambda: asyncio.sleep(0, ready.is_set()), timeout_s=30)
            yield api
        finally:
            stop.set()
            # kopf waits for the sync handlers still running in its executor: after a scale-down's burst of child
            # events, a CI run on 2 busy cores did not see the operator stop within 30 s
            await asyncio.to_thread(thread.join, 120)
            assert not thread.is_alive(), "the operator did not stop"
