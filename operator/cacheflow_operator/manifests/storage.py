"""The storage pods: a StatefulSet (stable names and one volume claim per pod) behind a headless Service."""

from __future__ import annotations

from typing import Any

from cacheflow_operator.manifests.common import (
    AUTH_DIR,
    AUTH_MOUNT,
    STORAGE_DATA_PORT,
    STORAGE_HTTP_PORT,
    auth_volume,
    container,
    metadata,
    pod_template,
    quantity,
    selector_labels,
    service,
    storage_name,
    tls_args,
    tls_mount,
    tls_volume,
)
from cacheflow_operator.spec import Cluster

COMPONENT = "storage"
DATA_DIR = "/data"
CAPACITY_SHARE = 0.9  # default LRU capacity: this share of the volume (room for temp files and the index)
PORTS = {"data": STORAGE_DATA_PORT, "http": STORAGE_HTTP_PORT}


def capacity(c: Cluster) -> str:
    """`--capacity`: the spec's, or 90% of the volume with the filesystem backend (0: unlimited)."""
    s = c.spec.storage
    if s.capacity:
        return s.capacity
    return str(int(quantity(s.volume_size) * CAPACITY_SHARE)) if s.backend == "filesystem" else "0"


def storage_args(c: Cluster) -> list[str]:
    s = c.spec.storage
    args = ["storage", "--backend", s.backend, "--host", "0.0.0.0", "--data-port", str(STORAGE_DATA_PORT),
            "--http-port", str(STORAGE_HTTP_PORT), "--token-file", f"{AUTH_DIR}/pod-tokens",
            "--rate-gbps", f"{s.link_rate_gbps:g}", "--transport", s.transport, "--capacity", capacity(c)]
    if s.link_capacity_gbps:
        args += ["--link-capacity-gbps", f"{s.link_capacity_gbps:g}"]
    if s.backend == "filesystem":
        args += ["--dir", DATA_DIR]
    if s.backend == "redis":
        args += ["--redis-url", s.redis_url]
    return args + tls_args(c)


def _claim_template(c: Cluster) -> dict[str, Any]:
    s = c.spec.storage
    spec: dict[str, Any] = {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": s.volume_size}}}
    if s.storage_class:
        spec["storageClassName"] = s.storage_class
    return {"metadata": {"name": "data", "labels": selector_labels(c, COMPONENT)}, "spec": spec}


def statefulset(c: Cluster) -> dict[str, Any]:
    s = c.spec.storage
    filesystem = s.backend == "filesystem"
    mounts = [AUTH_MOUNT, *tls_mount(c)] + ([{"name": "data", "mountPath": DATA_DIR}] if filesystem else [])
    pod = container(c, "storage", storage_args(c), PORTS, resources=s.resources, mounts=mounts, startup_s=120)
    spec: dict[str, Any] = {
        "serviceName": storage_name(c),
        "replicas": s.pods,
        "podManagementPolicy": "Parallel",  # the pods are independent: start and stop them all at once
        "selector": {"matchLabels": selector_labels(c, COMPONENT)},
        "template": pod_template(c, COMPONENT, [pod], [auth_volume(c, "pod-tokens"), *tls_volume(c, server=True)],
                                 metrics_port=STORAGE_HTTP_PORT,
                                 extra_spec={"terminationGracePeriodSeconds": 30}),
    }
    if filesystem:
        spec["volumeClaimTemplates"] = [_claim_template(c)]
        spec["persistentVolumeClaimRetentionPolicy"] = {"whenDeleted": "Delete" if s.delete_volumes else "Retain",
                                                        "whenScaled": "Retain"}
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": metadata(c, storage_name(c), COMPONENT),
            "spec": spec}


def headless_service(c: Cluster) -> dict[str, Any]:
    """Gives every storage pod its DNS name `<sts>-<i>.<sts>.<namespace>.svc`, which workers dial."""
    return service(c, storage_name(c), COMPONENT, PORTS, headless=True)
