"""A small Kubernetes REST client over the official client's transport: manifests are plain dicts both ways.

Only the calls the operator makes: get, list (by label), create, server-side apply, merge-patch (an
object or its status) and delete, for the kinds in `PLURALS`. Credentials: in-cluster service account, else
the kubeconfig.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

import kubernetes

from cacheflow_operator.spec import API_VERSION, KIND, PLURAL

PLURALS = {("v1", "ConfigMap"): "configmaps", ("v1", "Service"): "services", ("v1", "Secret"): "secrets",
           ("apps/v1", "Deployment"): "deployments", ("apps/v1", "StatefulSet"): "statefulsets",
           ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies", (API_VERSION, KIND): PLURAL}
MERGE_PATCH = "application/merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply (the body is JSON, which is YAML)


class KubeError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"Kubernetes API {status}: {message}")
        self.status = status


@dataclass(frozen=True)
class Ref:
    """Where an object lives: its kind (apiVersion + kind), namespace and name."""

    api_version: str
    kind: str
    namespace: str
    name: str = ""

    @classmethod
    def of(cls, obj: dict[str, Any]) -> Ref:
        meta = obj["metadata"]
        return cls(obj["apiVersion"], obj["kind"], meta["namespace"], meta.get("name", ""))

    def path(self, subresource: str = "") -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{prefix}/namespaces/{self.namespace}/{PLURALS[self.api_version, self.kind]}"
        return "/".join(p for p in (path, self.name, subresource) if p)

    def __str__(self) -> str:
        return f"{self.kind} {self.namespace}/{self.name}"


class Kube:
    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self.api = api

    @classmethod
    def from_environment(cls) -> Kube:
        """In a pod: its service account; elsewhere: the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # read now, not at import
        return cls(kubernetes.client.ApiClient())

    def _call(self, method: str, path: str, *, body: Any = None, query: list[tuple[str, str]] | None = None,
              content_type: str = "application/json", missing_ok: bool = False) -> dict[str, Any] | None:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        request = self.api.param_serialize(method, path, query_params=query or [], header_params=headers, body=body,
                                           auth_settings=["BearerToken"])
        response = self.api.call_api(*request)
        response.read()
        if response.status == 404 and missing_ok:
            return None
        if not 200 <= response.status < 300:
            raise KubeError(response.status, (response.data or b"").decode(errors="replace")[:500])
        decoded: dict[str, Any] = json.loads(response.data) if response.data else {}
        return decoded

    def get(self, ref: Ref) -> dict[str, Any] | None:
        return self._call("GET", ref.path(), missing_ok=True)

    def list(self, ref: Ref, selector: dict[str, str]) -> list[dict[str, Any]]:
        query = [("labelSelector", ",".join(f"{k}={v}" for k, v in selector.items()))]
        listed = self._call("GET", ref.path(), query=query) or {}
        return list(listed.get("items") or [])

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        return self._call("POST", replace(Ref.of(obj), name="").path(), body=obj)  # to the collection

    def patch(self, ref: Ref, patch: dict[str, Any], *, subresource: str = "") -> dict[str, Any] | None:
        """An RFC 7386 JSON merge patch: dicts merge, lists and scalars replace, null removes."""
        return self._call("PATCH", ref.path(subresource), body=patch, content_type=MERGE_PATCH)

    def apply(self, obj: dict[str, Any], *, field_manager: str, force: bool = False) -> dict[str, Any] | None:
        """Server-side apply: `obj` is this manager's whole intent for the object (created if missing); fields it
        set before and leaves out now are removed. `force` takes over fields another manager set differently."""
        query = [("fieldManager", field_manager), *([("force", "true")] if force else [])]
        return self._call("PATCH", Ref.of(obj).path(), body=obj, query=query, content_type=APPLY_PATCH)

    def delete(self, ref: Ref) -> None:
        self._call("DELETE", ref.path(), body={"propagationPolicy": "Background"}, missing_ok=True)
