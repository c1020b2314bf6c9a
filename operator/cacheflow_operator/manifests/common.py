"""Names, labels, owner references and the pod parts every CacheFlow workload shares."""

from __future__ import annotations

import math
import re
from typing import Any

from cacheflow_operator.spec import API_VERSION, KIND, Cluster

COORDINATOR_PORT = 8000  # the OpenAI-compatible API
WORKER_PORT = 7500  # a stage worker's control API
STORAGE_DATA_PORT = 7400  # a storage pod's data plane
STORAGE_HTTP_PORT = 7401  # a storage pod's control API (probes, metrics)
AUTH_DIR = "/etc/cacheflow/auth"  # the auth Secret's files
INTERNAL_DIR = "/etc/cacheflow/internal"  # the internal Secret's files (internal token, grant keys)
TLS_DIR = "/etc/cacheflow/tls"  # the TLS Secret's files a pod needs (ca.crt; a server's tls.crt and tls.key too)
PROFILE_DIR = "/etc/cacheflow/profile"
MODELS_DIR = "/models"
MANAGER = "cacheflow-operator"
RUN_AS = 10001  # the image's user (Dockerfile)

Manifest = dict[str, Any]


# ---------------------------------------------------------------------------------------------- names
def coordinator_name(c: Cluster) -> str:
    return f"{c.name}-coordinator"


def stage_name(c: Cluster, stage: int) -> str:
    return f"{c.name}-stage-{stage}"


def storage_name(c: Cluster) -> str:
    return f"{c.name}-storage"


def config_name(c: Cluster) -> str:
    return f"{c.name}-spec"


def internal_secret_name(c: Cluster) -> str:
    """The Secret with the cluster's internal token and grant keys (created once by the operator, never replaced)."""
    return f"{c.name}-internal"


def tls_secret_name(c: Cluster) -> str:
    """The Secret with the cluster CA and the internal hops' server certificate (made and renewed by the operator)."""
    return f"{c.name}-tls"


def tls_hosts(c: Cluster) -> list[str]:
    """The names the server certificate is for: every Service of the namespace, and the storage pods' DNS names."""
    ns, sts = c.namespace, storage_name(c)
    return [f"*.{ns}.svc", f"*.{sts}.{ns}.svc", f"*.{ns}.svc.cluster.local", f"*.{sts}.{ns}.svc.cluster.local"]


def storage_pod_id(c: Cluster, i: int) -> str:
    """Storage pod i's id, `<cluster>-storage-<i>`: its StatefulSet pod's name. Placement hashes the ids, so every
    client of the pods uses these: the workers and coordinator (`pod_addresses`), and a vLLM connector (the
    `pods` the chart's NOTES print, the README's example: tests/k8s/test_chart.py, tests/services/test_pod_ids.py)."""
    return f"{storage_name(c)}-{i}"


def pod_addresses(c: Cluster) -> list[str]:
    """`id=host:port` of every storage pod's data plane: its id, at the StatefulSet's stable DNS name for it."""
    sts = storage_name(c)
    return [f"{storage_pod_id(c, i)}={storage_pod_id(c, i)}.{sts}.{c.namespace}.svc:{STORAGE_DATA_PORT}"
            for i in range(c.spec.storage.pods)]


def stage_urls(c: Cluster) -> list[str]:
    scheme = "https" if c.spec.tls.enabled else "http"
    return [f"{scheme}://{stage_name(c, s)}.{c.namespace}.svc:{WORKER_PORT}" for s in range(c.spec.stages.count)]


def coordinator_url(c: Cluster) -> str:
    return f"http://{coordinator_name(c)}.{c.namespace}.svc:{COORDINATOR_PORT}"


# --------------------------------------------------------------------------------------------- labels
def selector_labels(c: Cluster, component: str, **extra: str) -> dict[str, str]:
    """Stable labels that select a component's pods (selectors are immutable: nothing here may change)."""
    return {"app.kubernetes.io/name": "cacheflow", "app.kubernetes.io/instance": c.name,
            "app.kubernetes.io/component": component, **extra}


def labels(c: Cluster, component: str, **extra: str) -> dict[str, str]:
    return {**selector_labels(c, component, **extra), "app.kubernetes.io/part-of": "cacheflow",
            "app.kubernetes.io/managed-by": MANAGER, "app.kubernetes.io/version": c.spec.image.tag,
            "cacheflow.io/cluster": c.name}


def owner_reference(c: Cluster) -> dict[str, Any]:
    """Makes the resource the controller of a child: Kubernetes' garbage collector deletes it with the resource."""
    return {"apiVersion": API_VERSION, "kind": KIND, "name": c.name, "uid": c.uid, "controller": True,
            "blockOwnerDeletion": True}


def metadata(c: Cluster, name: str, component: str, **extra: str) -> dict[str, Any]:
    return {"name": name, "namespace": c.namespace, "labels": labels(c, component, **extra),
            "ownerReferences": [owner_reference(c)]}


# ------------------------------------------------------------------------------------------ pod parts
def http_probe(path: str, port: int, *, period_s: int, failures: int, scheme: str = "HTTP") -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port, "scheme": scheme}, "periodSeconds": period_s,
            "failureThreshold": failures, "timeoutSeconds": 5}


def probes(port: int, *, startup_s: int, scheme: str = "HTTP") -> dict[str, Any]:
    """Startup (model loads can take minutes), readiness (/readyz) and liveness (/healthz)."""
    return {"startupProbe": http_probe("/healthz", port, period_s=5, failures=max(1, startup_s // 5), scheme=scheme),
            "readinessProbe": http_probe("/readyz", port, period_s=5, failures=3, scheme=scheme),
            "livenessProbe": http_probe("/healthz", port, period_s=10, failures=6, scheme=scheme)}


def container(c: Cluster, name: str, args: list[str], ports: dict[str, int], *, resources: dict[str, Any],
              mounts: list[dict[str, Any]], startup_s: int, env: list[dict[str, Any]] | None = None
              ) -> dict[str, Any]:
    """A `cacheflow <args>` container (the image's entry point is the `cacheflow` command); `env`: more variables.
    Its API port is named "http", or "https" where it serves TLS (probed so)."""
    api = "https" if "https" in ports else "http"
    return {
        "name": name,
        "image": c.spec.image.ref,
        "imagePullPolicy": c.spec.image.pull_policy,
        "args": args,
        "ports": [{"name": port_name, "containerPort": port, "protocol": "TCP"} for port_name, port in ports.items()],
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/huggingface"}, *(env or [])],
        "resources": resources,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *mounts],
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
        **probes(ports[api], startup_s=startup_s, scheme=api.upper()),
    }


def pod_template(c: Cluster, component: str, containers: list[dict[str, Any]], volumes: list[dict[str, Any]],
                 *, metrics_port: int, extra_spec: dict[str, Any] | None = None, **extra_labels: str
                 ) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": containers,
        "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
        "automountServiceAccountToken": False,  # no pod of the service talks to the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        **(extra_spec or {}),
    }
    if c.spec.image.pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in c.spec.image.pull_secrets]
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port),
                   "prometheus.io/path": "/metrics"}
    return {"metadata": {"labels": labels(c, component, **extra_labels), "annotations": annotations}, "spec": spec}


def auth_volume(c: Cluster, *keys: str) -> dict[str, Any]:
    """The auth Secret, only the `keys` this pod needs (storage pods never see the clients' tokens)."""
    return {"name": "auth", "secret": {"secretName": c.spec.auth.secret_name, "defaultMode": 0o440,
                                       "items": [{"key": k, "path": k} for k in keys]}}


AUTH_MOUNT = {"name": "auth", "mountPath": AUTH_DIR, "readOnly": True}


def internal_volume(c: Cluster, *keys: str) -> dict[str, Any]:
    """The internal Secret, only the `keys` this pod needs (the coordinator's signing key is on no other pod)."""
    return {"name": "internal", "secret": {"secretName": internal_secret_name(c), "defaultMode": 0o440,
                                           "items": [{"key": k, "path": k} for k in keys]}}


INTERNAL_MOUNT = {"name": "internal", "mountPath": INTERNAL_DIR, "readOnly": True}


def tls_volume(c: Cluster, *, server: bool) -> list[dict[str, Any]]:
    """The TLS Secret: ca.crt, with `server` the certificate and key too (the CA's key stays with the operator);
    none where TLS is off."""
    if not c.spec.tls.enabled:
        return []
    keys = ["ca.crt", "tls.crt", "tls.key"] if server else ["ca.crt"]
    return [{"name": "tls", "secret": {"secretName": tls_secret_name(c), "defaultMode": 0o440,
                                       "items": [{"key": k, "path": k} for k in keys]}}]


def tls_mount(c: Cluster) -> list[dict[str, Any]]:
    return [{"name": "tls", "mountPath": TLS_DIR, "readOnly": True}] if c.spec.tls.enabled else []


def tls_args(c: Cluster) -> list[str]:
    return ["--tls-dir", TLS_DIR] if c.spec.tls.enabled else []


def service(c: Cluster, name: str, component: str, ports: dict[str, int], *, service_type: str = "ClusterIP",
            headless: bool = False, **extra: str) -> dict[str, Any]:
    meta = metadata(c, name, component, **extra)
    meta["labels"]["cacheflow.io/metrics"] = "true"  # the chart's ServiceMonitor scrapes every port named http
    spec: dict[str, Any] = {"type": service_type, "selector": selector_labels(c, component, **extra),
                            "ports": [{"name": n, "port": p, "targetPort": n, "protocol": "TCP"}
                                      for n, p in ports.items()]}
    if headless:
        spec["clusterIP"] = "None"
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}


# -------------------------------------------------------------------------------------------- quantities
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?")
_FACTORS = {None: 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity ("500m", "50Gi", 2) as a number."""
    match = _QUANTITY.fullmatch(str(value))
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(match.group(1)) * _FACTORS[match.group(2)]


def cpu_threads(resources: dict[str, Any]) -> int:
    """Torch threads for a container: its CPU limit (else request), at least 1; 0 when neither is set."""
    cpu = resources.get("limits", {}).get("cpu") or resources.get("requests", {}).get("cpu")
    return max(1, math.floor(quantity(cpu))) if cpu else 0
