"""The coordinator: a Deployment (the OpenAI-compatible API, batching) and its Service."""

from __future__ import annotations

from typing import Any

from cacheflow_common.auth import INTERNAL_TOKEN_FILE, SIGNING_KEY_FILE
from cacheflow_operator.manifests.common import (
    AUTH_DIR,
    AUTH_MOUNT,
    COORDINATOR_PORT,
    INTERNAL_DIR,
    INTERNAL_MOUNT,
    auth_volume,
    container,
    coordinator_name,
    internal_volume,
    metadata,
    pod_addresses,
    pod_template,
    selector_labels,
    service,
    stage_urls,
    tls_args,
    tls_mount,
    tls_volume,
)
from cacheflow_operator.manifests.workers import model_volumes
from cacheflow_operator.spec import Cluster

COMPONENT = "coordinator"


def coordinator_args(c: Cluster) -> list[str]:
    b = c.spec.coordinator.batching
    return ["coordinator", "--stages", ",".join(stage_urls(c)), "--pods", ",".join(pod_addresses(c)),
            "--pod-token-file", f"{AUTH_DIR}/pod-tokens", "--token-file", f"{AUTH_DIR}/api-tokens",
            "--internal-token-file", f"{INTERNAL_DIR}/{INTERNAL_TOKEN_FILE}",
            "--grant-signing-key-file", f"{INTERNAL_DIR}/{SIGNING_KEY_FILE}",
            "--model", c.spec.model.source, "--replicas", str(c.spec.storage.chunk_replicas),
            "--batch-window-ms", f"{b.window_ms:g}", "--max-batch", str(b.max_batch),
            "--max-queue", str(b.max_queue), "--host", "0.0.0.0", "--http-port", str(COORDINATOR_PORT), *tls_args(c)]


def deployment(c: Cluster) -> dict[str, Any]:
    volumes, mounts = model_volumes(c)
    pod = container(c, "coordinator", coordinator_args(c), {"http": COORDINATOR_PORT},
                    resources=c.spec.coordinator.resources, mounts=[AUTH_MOUNT, INTERNAL_MOUNT, *tls_mount(c), *mounts],
                    startup_s=300)
    # the only pod with the grant signing key (and, with the pods' tokens, the only one that can make credentials)
    secrets = [auth_volume(c, "api-tokens", "pod-tokens"), internal_volume(c, INTERNAL_TOKEN_FILE, SIGNING_KEY_FILE),
               *tls_volume(c, server=False)]
    template = pod_template(c, COMPONENT, [pod], [*secrets, *volumes], metrics_port=COORDINATOR_PORT)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": metadata(c, coordinator_name(c), COMPONENT),
        "spec": {"replicas": c.spec.coordinator.replicas, "selector": {"matchLabels": selector_labels(c, COMPONENT)},
                 "template": template},
    }


def api_service(c: Cluster) -> dict[str, Any]:
    return service(c, coordinator_name(c), COMPONENT, {"http": COORDINATOR_PORT},
                   service_type=c.spec.coordinator.service_type)
