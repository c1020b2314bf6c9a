"""NetworkPolicies: every pod of the cluster is denied every path in and out but the ones it needs.

    clients (anywhere)   -> coordinator :8000 (the API; /metrics is on it too)
    coordinator          -> every stage :7500 (control), storage pods :7400 (prefix lookups, health probes)
    stage s              -> stage s+1 :7500 (hidden states), storage pods :7400 (chunks)
    Prometheus           -> stage workers :7500, storage pods :7401 (/metrics; selected by spec.networkPolicy)
    every pod            -> DNS (:53)
    storage pods         -> Redis (its URL's port and namespace) with the redis backend; stage workers, any port, with
                            transport nixl (UCX over TCP opens its own connections to the reader)

Probes need no rule: traffic from a pod's own node (the kubelet) is always allowed. Labels are what the
policies select by, and anyone who may create pods in the namespace can copy them: the internal token and
the coordinator's grants (cacheflow_common/auth.py), not these policies, are what authenticates a caller.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from cacheflow_operator.manifests.common import (
    COORDINATOR_PORT,
    MANAGER,
    STORAGE_DATA_PORT,
    STORAGE_HTTP_PORT,
    WORKER_PORT,
    metadata,
    selector_labels,
)
from cacheflow_operator.manifests.coordinator import COMPONENT as COORDINATOR
from cacheflow_operator.manifests.storage import COMPONENT as STORAGE
from cacheflow_operator.manifests.workers import COMPONENT as WORKER
from cacheflow_operator.spec import Cluster

COMPONENT = "network-policy"
DNS_PORT = 53
REDIS_PORT = 6379  # a redis:// URL's default port
Rule = dict[str, Any]


def _pods(labels: dict[str, str]) -> dict[str, Any]:
    return {"podSelector": {"matchLabels": labels}}


def _tcp(*ports: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": p} for p in ports]


def _stage(c: Cluster, stage: int) -> dict[str, Any]:
    return _pods(selector_labels(c, WORKER, **{"cacheflow.io/stage": str(stage)}))


def cluster_pods(c: Cluster) -> dict[str, str]:
    """Every pod the operator runs for this cluster (not the operator's own pod: Helm manages that one)."""
    return {"app.kubernetes.io/name": "cacheflow", "app.kubernetes.io/instance": c.name,
            "app.kubernetes.io/managed-by": MANAGER}


def metrics_peer(c: Cluster) -> dict[str, Any]:
    """Prometheus: pods with these labels in namespaces with those (both must match)."""
    n = c.spec.network_policy
    return {"namespaceSelector": {"matchLabels": dict(n.metrics_namespace_labels)},
            "podSelector": {"matchLabels": dict(n.metrics_pod_labels)}}


DNS_EGRESS: Rule = {"ports": [{"protocol": "UDP", "port": DNS_PORT}, {"protocol": "TCP", "port": DNS_PORT}]}


def policy(c: Cluster, name: str, selector: dict[str, str], ingress: list[Rule], egress: list[Rule]
           ) -> dict[str, Any]:
    """One NetworkPolicy isolating the selected pods both ways; `ingress` and `egress` are what it allows."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(c, name, COMPONENT),
            "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress", "Egress"],
                     "ingress": ingress, "egress": egress}}


def default_deny(c: Cluster) -> dict[str, Any]:
    """Nothing in or out for any pod of the cluster; the policies below each open their component's paths."""
    return policy(c, f"{c.name}-default-deny", cluster_pods(c), [], [])


def coordinator_policy(c: Cluster) -> dict[str, Any]:
    egress = [{"to": [_pods(selector_labels(c, WORKER))], "ports": _tcp(WORKER_PORT)},
              {"to": [_pods(selector_labels(c, STORAGE))], "ports": _tcp(STORAGE_DATA_PORT)}, DNS_EGRESS]
    return policy(c, f"{c.name}-coordinator", selector_labels(c, COORDINATOR),
                  [{"ports": _tcp(COORDINATOR_PORT)}], egress)  # clients from anywhere (a LoadBalancer, say)


def stage_policy(c: Cluster, stage: int) -> dict[str, Any]:
    callers = [_pods(selector_labels(c, COORDINATOR)), *([_stage(c, stage - 1)] if stage else [])]
    ingress = [{"from": callers, "ports": _tcp(WORKER_PORT)}, {"from": [metrics_peer(c)], "ports": _tcp(WORKER_PORT)}]
    egress = [{"to": [_pods(selector_labels(c, STORAGE))], "ports": _tcp(STORAGE_DATA_PORT)}]
    if stage + 1 < c.spec.stages.count:
        egress.append({"to": [_stage(c, stage + 1)], "ports": _tcp(WORKER_PORT)})
    if c.spec.storage.transport == "nixl":
        ingress.append({"from": [_pods(selector_labels(c, STORAGE))]})  # UCX's own connections, any port
    selector = selector_labels(c, WORKER, **{"cacheflow.io/stage": str(stage)})
    return policy(c, f"{c.name}-stage-{stage}", selector, ingress, [*egress, DNS_EGRESS])


def redis_egress(url: str) -> Rule:
    """To Redis on its URL's port: in its namespace where the host is a Service name (<svc>.<ns>.svc...),
    else (an address outside the cluster, a bare name) to any address on that port."""
    parts = urlsplit(url)
    rule: Rule = {"ports": _tcp(parts.port or REDIS_PORT)}
    labels = (parts.hostname or "").split(".")
    if len(labels) >= 3 and labels[2] == "svc":
        rule["to"] = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": labels[1]}}}]
    return rule


def storage_policy(c: Cluster) -> dict[str, Any]:
    s, n = c.spec.storage, c.spec.network_policy
    readers = [_pods(selector_labels(c, WORKER)), _pods(selector_labels(c, COORDINATOR))]
    if n.data_plane_client_labels:
        readers.append(_pods(dict(n.data_plane_client_labels)))
    ingress = [{"from": readers, "ports": _tcp(STORAGE_DATA_PORT)},
               {"from": [metrics_peer(c)], "ports": _tcp(STORAGE_HTTP_PORT)}]
    egress = [DNS_EGRESS]
    if s.backend == "redis":
        egress.append(redis_egress(s.redis_url))
    if s.transport == "nixl":
        egress.append({"to": [_pods(selector_labels(c, WORKER))]})
    return policy(c, f"{c.name}-storage", selector_labels(c, STORAGE), ingress, egress)


def network_policies(c: Cluster) -> list[dict[str, Any]]:
    """The cluster's NetworkPolicies; none when spec.networkPolicy.enabled is false."""
    if not c.spec.network_policy.enabled:
        return []
    stages = [stage_policy(c, s) for s in range(c.spec.stages.count)]
    return [default_deny(c), coordinator_policy(c), *stages, storage_policy(c)]
