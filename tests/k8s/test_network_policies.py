"""The NetworkPolicies: the operator's pod's (rendered by the chart, through the real Helm engine) and each
cluster's (built by the operator from the CacheFlowCluster the chart renders), valid against the Kubernetes
schemas, and allowing exactly the intended paths. No network plugin runs here: `netpol.allowed` evaluates the
policies by the NetworkPolicy rules, and every (source, destination, port) of a set of pods and addresses is
compared with the intended set, so a policy that lets one more path through fails as surely as a missing one.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from cacheflow_operator.manifests.build import children
from cacheflow_operator.manifests.network import network_policies
from cacheflow_operator.spec import KIND, Cluster
from tests.k8s.checks import by_kind, validate_all
from tests.k8s.netpol import Endpoint, allowed, pod_of
from tests.k8s.test_chart import NAMESPACE, render

PORTS = [(53, "UDP"), (53, "TCP"), (443, "TCP"), (6443, "TCP"), (6379, "TCP"), (7400, "TCP"), (7401, "TCP"),
         (7500, "TCP"), (8000, "TCP"), (8080, "TCP"), (40000, "TCP")]
DNS = {(53, "UDP"), (53, "TCP")}
Path = tuple[str, str, int, str]


def cluster_from(objs: list[dict[str, Any]]) -> Cluster:
    (resource,) = [o for o in objs if o["kind"] == KIND]
    return Cluster.from_resource({**resource, "metadata": {**resource["metadata"], "uid": "u"}})


def world(objs: list[dict[str, Any]], cluster: Cluster, prometheus: dict[str, str], prometheus_ns: str
          ) -> dict[str, Endpoint]:
    """The cluster's pods (labels from their templates), the operator's, and pods and addresses around them."""
    kids = children(cluster)
    pods = {name: pod_of(w) for name, w in {**by_kind(kids, "Deployment"), **by_kind(kids, "StatefulSet")}.items()}
    (operator,) = by_kind(objs, "Deployment").values()
    return {
        **pods,
        "operator": pod_of(operator),
        "tenant-pod": Endpoint("tenant-pod", NAMESPACE, {"app": "notebook"}),
        "vllm": Endpoint("vllm", NAMESPACE, {"app": "vllm"}),
        "other-ns-pod": Endpoint("other-ns-pod", "tenants", {"app": "client"}),
        "internet": Endpoint("internet", None, ip="203.0.113.7"),
        "api-server": Endpoint("api-server", None, ip="10.0.0.1"),
        "dns": Endpoint("dns", "kube-system", {"k8s-app": "kube-dns"}),
        "redis": Endpoint("redis", "cache", {"app": "redis"}),
        "prometheus": Endpoint("prometheus", prometheus_ns, dict(prometheus)),
        "not-prometheus": Endpoint("not-prometheus", prometheus_ns, {"app": "grafana"}),
        # Prometheus's labels, but in the wrong namespace: the namespace must match too
        "fake-prometheus": Endpoint("fake-prometheus", NAMESPACE, dict(prometheus)),
    }


def intended(cluster: Cluster, pods: dict[str, Endpoint], *, vllm: bool = False, redis: bool = False,
             api_anywhere: bool = False) -> set[Path]:
    """Every path the design allows, and nothing else (see operator/cacheflow_operator/manifests/network.py)."""
    name = cluster.name
    stages = [f"{name}-stage-{s}" for s in range(cluster.spec.stages.count)]
    coordinator, storage, ours = f"{name}-coordinator", f"{name}-storage", [f"{name}-coordinator", *stages]
    paths: set[Path] = set()
    for src in pods:  # anything not isolated (every pod but ours and the operator) may reach the coordinator's API
        if src not in (*ours, storage) and src != "operator":
            paths.add((src, coordinator, 8000, "TCP"))
    paths |= {(coordinator, s, 7500, "TCP") for s in stages}
    paths |= {(a, b, 7500, "TCP") for a, b in itertools.pairwise(stages)}
    paths |= {(s, storage, 7400, "TCP") for s in ours}
    paths |= {("prometheus", s, 7500, "TCP") for s in stages} | {("prometheus", storage, 7401, "TCP")}
    # DNS to any address on port 53 (CoreDNS's pods, NodeLocal DNSCache on the node, a provider's resolver)
    isolated = [*ours, storage, "operator"]
    paths |= {(s, d, port, proto) for s in isolated for d in pods if d not in isolated for port, proto in DNS}
    api = [d for d, p in pods.items() if p.ip] if api_anywhere else ["api-server"]
    paths |= {("operator", d, port, "TCP") for d in api for port in (443, 6443)}
    if vllm:
        paths.add(("vllm", storage, 7400, "TCP"))
    if redis:
        paths.add((storage, "redis", 6379, "TCP"))
    return paths


def unmanaged_paths(pods: dict[str, Endpoint], policies: list[dict[str, Any]]) -> set[Path]:
    """Paths between endpoints no policy here isolates (tenant pods, Prometheus, ...): not this chart's to decide."""
    ours = {n for n, p in pods.items() if any(_selected(pol, p) for pol in policies)}
    return {(a, b, port, proto) for a, b in itertools.permutations(pods, 2) for port, proto in PORTS
            if a not in ours and b not in ours}


def _selected(policy: dict[str, Any], pod: Endpoint) -> bool:
    labels = policy["spec"]["podSelector"].get("matchLabels", {})
    return policy["metadata"]["namespace"] == pod.namespace and labels.items() <= pod.labels.items()


def reachable(policies: list[dict[str, Any]], pods: dict[str, Endpoint]) -> set[Path]:
    return {(a, b, port, proto) for (a, src), (b, dst) in itertools.permutations(pods.items(), 2)
            for port, proto in PORTS if allowed(policies, src, dst, port, proto)}


def all_policies(objs: list[dict[str, Any]], cluster: Cluster) -> list[dict[str, Any]]:
    return [*[o for o in objs if o["kind"] == "NetworkPolicy"], *network_policies(cluster)]


CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    # rendered offline, Helm's lookup of the API server's EndpointSlice finds nothing: any address on its ports
    "default": ({}, {"api_anywhere": True}),
    "4-stages-own-prometheus-vllm": ({
        "cluster": {"spec": {"stages": {"count": 4}, "model": {"layers": 8, "source": "tiny"}}},
        "networkPolicy": {"metrics": {"namespaceLabels": {"kubernetes.io/metadata.name": "observability"},
                                      # Helm merges maps: null drops the default's label
                                      "podLabels": {"app.kubernetes.io/name": None, "app": "prom"}},
                          "dataPlaneClientLabels": {"app": "vllm"},
                          "apiServer": {"cidrs": ["10.0.0.1/32"], "ports": [443, 6443]}}}, {"vllm": True}),
    # redis.cache.svc: the pods of namespace cache, on the URL's port
    "redis": ({"networkPolicy": {"apiServer": {"cidrs": ["10.0.0.0/24"]}},
               "cluster": {"spec": {"storage": {"backend": "redis", "redisUrl": "redis://redis.cache.svc:6379/0",
                                                "pods": 1}}}}, {"redis": True}),
}


@pytest.mark.parametrize(("values", "extra"), CASES.values(), ids=CASES.keys())
def test_the_policies_allow_exactly_the_intended_paths(values, extra):
    objs = render(values)
    cluster = cluster_from(objs)
    policies = all_policies(objs, cluster)
    validate_all(policies)
    metrics = values.get("networkPolicy", {}).get("metrics", {})
    prom_ns = metrics.get("namespaceLabels", {}).get("kubernetes.io/metadata.name", "monitoring")
    prom = {k: v for k, v in metrics.get("podLabels", {"app.kubernetes.io/name": "prometheus"}).items() if v}
    pods = world(objs, cluster, prom, prom_ns)
    got = reachable(policies, pods) - unmanaged_paths(pods, policies)
    want = intended(cluster, pods, **extra)
    assert got - want == set(), "too open"
    assert want - got == set(), "too closed"


def test_the_policies_select_the_pods_the_operator_runs():
    """Each component's policy selects exactly its pods (labels from the pod templates), the default-deny every
    pod of the cluster, and none of them the operator's pod (the chart's policy covers that one alone)."""
    objs = render({"cluster": {"spec": {"stages": {"count": 3}, "model": {"layers": 9, "source": "tiny"}}}})
    cluster = cluster_from(objs)
    pods = world(objs, cluster, {"app.kubernetes.io/name": "prometheus"}, "monitoring")
    selected = {p["metadata"]["name"]: sorted(n for n, pod in pods.items() if _selected(p, pod))
                for p in all_policies(objs, cluster)}
    ours = sorted(["cacheflow-coordinator", "cacheflow-storage", *[f"cacheflow-stage-{s}" for s in range(3)]])
    assert selected == {"cacheflow-operator": ["operator"], "cacheflow-default-deny": ours,
                        "cacheflow-coordinator": ["cacheflow-coordinator"], "cacheflow-storage": ["cacheflow-storage"],
                        **{f"cacheflow-stage-{s}": [f"cacheflow-stage-{s}"] for s in range(3)}}
    for policy in all_policies(objs, cluster):
        assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"], policy["metadata"]["name"]


def test_nixl_lets_the_storage_pods_connect_back_to_the_workers_only():
    objs = render({"cluster": {"spec": {"storage": {"transport": "nixl"}}}})
    cluster = cluster_from(objs)
    policies = all_policies(objs, cluster)
    validate_all(policies)
    pods = world(objs, cluster, {"app.kubernetes.io/name": "prometheus"}, "monitoring")
    got = reachable(policies, pods) - unmanaged_paths(pods, policies)
    ucx = {("cacheflow-storage", f"cacheflow-stage-{s}", port, proto) for s in range(2) for port, proto in PORTS}
    assert got - intended(cluster, pods, api_anywhere=True) == ucx


def test_turned_off_there_are_none():
    objs = render({"networkPolicy": {"enabled": False}})
    assert [o for o in objs if o["kind"] == "NetworkPolicy"] == []
    cluster = cluster_from(objs)
    assert cluster.spec.network_policy.enabled is False
    assert [o for o in children(cluster) if o["kind"] == "NetworkPolicy"] == []


def test_the_operators_own_policy_is_rendered_valid():
    (policy,) = [o for o in render({}) if o["kind"] == "NetworkPolicy"]
    validate_all([policy])
    assert policy["spec"]["ingress"] == []  # its liveness probe is the kubelet's, from the node
