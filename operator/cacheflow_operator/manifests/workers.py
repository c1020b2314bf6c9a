"""One Deployment and one Service per pipeline stage: stage `s` owns its layers and knows stage `s+1`'s URL."""

from __future__ import annotations

from typing import Any

from cacheflow_common.auth import INTERNAL_TOKEN_FILE, VERIFY_KEY_FILE
from cacheflow_operator.manifests.common import (
    INTERNAL_DIR,
    INTERNAL_MOUNT,
    MODELS_DIR,
    PROFILE_DIR,
    WORKER_PORT,
    container,
    cpu_threads,
    internal_volume,
    metadata,
    pod_addresses,
    pod_template,
    selector_labels,
    service,
    stage_name,
    stage_urls,
    tls_args,
    tls_mount,
    tls_volume,
)
from cacheflow_operator.spec import Cluster

COMPONENT = "stage-worker"
GPU_RESOURCE = "nvidia.com/gpu"
STARTUP_S = 900  # loading a large model's layers from a volume can take minutes
POD_IP = "POD_IP"  # the downward API's status.podIP: a worker listens on its pod's address only
POD_IP_ENV = {"name": POD_IP, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}}


def worker_args(c: Cluster, stage: int) -> list[str]:
    st, layers = c.spec.stages, c.spec.split()[stage]
    args = ["worker", "--stage", str(stage), "--layers", f"{layers.start}:{layers.stop}",
            "--model", c.spec.model.source, "--dtype", c.spec.model.dtype, "--chunk-size", str(st.chunk_size),
            "--pods", ",".join(pod_addresses(c)), "--internal-token-file", f"{INTERNAL_DIR}/{INTERNAL_TOKEN_FILE}",
            "--grant-key-file", f"{INTERNAL_DIR}/{VERIFY_KEY_FILE}",
            "--replicas", str(c.spec.storage.chunk_replicas), "--policy", st.policy,
            "--pool-tokens", str(st.pool_tokens), "--tenant-pool-share", f"{st.tenant_pool_share:g}",
            "--host", f"$({POD_IP})", "--http-port", str(WORKER_PORT), *tls_args(c)]
    if stage + 1 < st.count:
        args += ["--next-stage", stage_urls(c)[stage + 1]]
    if st.profile_config_map:
        args += ["--profile", f"{PROFILE_DIR}/profile.json"]
    if threads := st.threads or cpu_threads(st.resources):
        args += ["--threads", str(threads)]
    return args


def worker_resources(c: Cluster) -> dict[str, Any]:
    """The spec's resources with the GPUs added as a limit (an extended resource's request defaults to it)."""
    res = {k: dict(v) for k, v in c.spec.stages.resources.items()}
    if c.spec.stages.gpus:
        res.setdefault("limits", {})[GPU_RESOURCE] = c.spec.stages.gpus
    return res


def model_volumes(c: Cluster) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The models claim, read-only at /models (workers load weights there, the coordinator its tokenizer)."""
    if not c.spec.model.volume_claim:
        return [], []
    return ([{"name": "models", "persistentVolumeClaim": {"claimName": c.spec.model.volume_claim, "readOnly": True}}],
            [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True}])


def deployment(c: Cluster, stage: int) -> dict[str, Any]:
    st, extra = c.spec.stages, {"cacheflow.io/stage": str(stage)}
    volumes, mounts = model_volumes(c)
    # the internal token and the grant verifying key; no tenant's storage token (grants carry pod credentials)
    volumes = [internal_volume(c, INTERNAL_TOKEN_FILE, VERIFY_KEY_FILE), *tls_volume(c, server=True), *volumes]
    mounts = [INTERNAL_MOUNT, *tls_mount(c), *mounts]
    if st.profile_config_map:
        volumes.append({"name": "profile", "configMap": {"name": st.profile_config_map}})
        mounts.append({"name": "profile", "mountPath": PROFILE_DIR, "readOnly": True})
    pod = container(c, "worker", worker_args(c, stage), api_port(c), resources=worker_resources(c),
                    mounts=mounts, startup_s=STARTUP_S, env=[POD_IP_ENV])
    pod_extra: dict[str, Any] = {"terminationGracePeriodSeconds": 60}  # a worker flushes its pending saves
    if st.node_selector:
        pod_extra["nodeSelector"] = dict(st.node_selector)
    if st.tolerations:
        pod_extra["tolerations"] = list(st.tolerations)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(c, stage_name(c, stage), COMPONENT, **extra),
        "spec": {
            "replicas": 1,  # a stage's KV pool holds requests' state: one worker per stage
            "strategy": {"type": "Recreate"},  # never two workers (and their GPUs) for one stage at once
            "selector": {"matchLabels": selector_labels(c, COMPONENT, **extra)},
            "template": pod_template(c, COMPONENT, [pod], volumes, metrics_port=WORKER_PORT, extra_spec=pod_extra,
                                     **extra),
        },
    }


def stage_service(c: Cluster, stage: int) -> dict[str, Any]:
    labels: dict[str, Any] = {"cacheflow.io/stage": str(stage)}  # not a keyword: the key has a dot and a slash
    return service(c, stage_name(c, stage), COMPONENT, api_port(c), **labels)


def api_port(c: Cluster) -> dict[str, int]:
    """The worker's API port, named for its scheme (the chart's ServiceMonitor scrapes https ports over TLS)."""
    return {"https" if c.spec.tls.enabled else "http": WORKER_PORT}
