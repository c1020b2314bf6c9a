"""What a set of NetworkPolicies allows, by the rules of networking.k8s.io/v1 (no network plugin runs here,
so the tests evaluate the policies themselves): a connection is allowed when the source's egress and the
destination's ingress both allow it. A pod no policy of its namespace selects for a direction is not isolated
in that direction; an isolated one allows what any selecting policy's rules allow (rules add up).

Supported: podSelector / namespaceSelector matchLabels (matchExpressions fail loudly), ipBlock (cidr, except),
numeric ports with protocol and endPort. Traffic from a pod's own node (kubelet probes) is out of scope.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

Manifest = dict[str, Any]


@dataclass(frozen=True)
class Endpoint:
    """A pod (namespace and labels) or, with namespace None, an address outside the cluster."""

    name: str
    namespace: str | None
    labels: dict[str, str] = field(default_factory=dict)
    ip: str = ""

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace} if self.namespace else {}


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"unsupported selector {selector}"
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def peer_matches(peer: dict[str, Any], other: Endpoint, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        if not other.ip:
            return False
        ip = ipaddress.ip_address(other.ip)
        net = ipaddress.ip_network(block["cidr"])
        return ip.version == net.version and ip in net and \
            not any(ip in ipaddress.ip_network(e) for e in block.get("except", []) if ip.version == net.version)
    if other.namespace is None:
        return False  # selectors pick pods, never outside addresses
    if "namespaceSelector" in peer:
        if not matches(peer["namespaceSelector"], other.namespace_labels):
            return False
    elif other.namespace != policy_namespace:
        return False  # a podSelector alone picks pods of the policy's own namespace
    return matches(peer.get("podSelector", {}), other.labels)


def port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True  # no ports: every port
    for p in ports:
        assert isinstance(p.get("port", 0), int), f"named ports are not evaluated: {p}"
        if p.get("protocol", "TCP") == protocol and (
                "port" not in p or p["port"] <= port <= p.get("endPort", p["port"])):
            return True
    return False


def _allows(policies: list[Manifest], pod: Endpoint, other: Endpoint, port: int, protocol: str,
            direction: str) -> bool:
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [p for p in policies if p["metadata"]["namespace"] == pod.namespace
                 and direction in p["spec"].get("policyTypes", ["Ingress"])
                 and matches(p["spec"]["podSelector"], pod.labels)]
    if pod.namespace is None or not selecting:
        return True  # not isolated
    for pol in selecting:
        for rule in pol["spec"].get(key) or []:
            peers = rule.get(peers_key)
            peer_ok = not peers or any(peer_matches(peer, other, pol["metadata"]["namespace"]) for peer in peers)
            if peer_ok and port_matches(rule.get("ports"), port, protocol):
                return True
    return False


def allowed(policies: list[Manifest], src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
    """Whether `src` may open a connection to `dst` on `port`."""
    return (_allows(policies, src, dst, port, protocol, "Egress")
            and _allows(policies, dst, src, port, protocol, "Ingress"))


def pod_of(workload: Manifest) -> Endpoint:
    """The pod a Deployment or StatefulSet runs, with the labels its template gives it."""
    meta = workload["metadata"]
    return Endpoint(meta["name"], meta["namespace"], dict(workload["spec"]["template"]["metadata"]["labels"]))
