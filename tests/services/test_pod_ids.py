"""A vLLM connector configured exactly as the README says finds the chunks a cluster the chart deployed stored.

Placement hashes the storage pods' ids, so a client that names the pods otherwise than the operator does
looks up about half the chunks on the wrong pod (a silent recompute). Here the README's
`kv_connector_extra_config` is parsed from the README itself, the operator's pod list is made for the
cluster the README installs (`helm install cacheflow ... -n cacheflow`, two pods), and both name real storage
pods on loopback: each DNS name the operator gives a pod resolves to that pod. Chunks stored through the
coordinator's placement (`tenant_stores`, what the coordinator and the workers build from the operator's
list) must all be found through the connector's (`open_store`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cacheflow_common.store.placement import tenant_stores
from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_operator.manifests.common import pod_addresses
from cacheflow_operator.spec import Cluster
from cacheflow_services.vllm_connector.both_sides import open_store
from cacheflow_services.vllm_connector.config import ConnectorConfig
from tests.services.chunks import make_chunks
from tests.services.procs import Pod, start_pod

README = Path(__file__).parents[2] / "README.md"
RELEASE = NAMESPACE = "cacheflow"  # the README's `helm install cacheflow ./charts/cacheflow -n cacheflow`


def readme_extra_config() -> dict[str, Any]:
    """The `kv_connector_extra_config` of the README's `vllm serve ... --kv-transfer-config '<JSON>'`."""
    found = re.search(r"vllm serve \S+ --kv-transfer-config '([^']+)'", README.read_text())
    assert found, "the README has no `vllm serve ... --kv-transfer-config '...'` example"
    extra: dict[str, Any] = json.loads(found.group(1))["kv_connector_extra_config"]
    return extra


def chart_cluster(pods: int) -> Cluster:
    """The CacheFlowCluster the README's `helm install` creates (the chart names it after the release)."""
    return Cluster.from_resource({"apiVersion": "cacheflow.io/v1alpha1", "kind": "CacheFlowCluster",
                                  "metadata": {"name": RELEASE, "namespace": NAMESPACE, "uid": "u"},
                                  "spec": {"storage": {"pods": pods}}})


def on_loopback(addresses: list[str], resolve: dict[str, str]) -> list[str]:
    """`id=host:port` with each host replaced by the loopback address its pod listens on (as DNS would)."""
    out = []
    for text in addresses:
        a = PodAddress.parse(text)
        assert a.host in resolve, f"{a.host} names no storage pod the operator deploys ({sorted(resolve)})"
        out.append(f"{a.pod_id}={resolve[a.host]}")
    return out


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Pod]]:
    root = tmp_path_factory.mktemp("pods")
    first = start_pod(root / "pod-0", backend="memory", tenants=("acme",))
    started = [first, start_pod(root / "pod-1", backend="memory", tokens=first.tokens)]
    yield started
    for pod in started:
        pod.stop()


def test_the_readme_names_the_pods_as_the_operator_does():
    extra = readme_extra_config()
    cluster = chart_cluster(len(extra["pods"]))
    assert extra["pods"] == pod_addresses(cluster)


def test_a_connector_configured_as_the_readme_says_finds_the_chunks_the_cluster_stored(pods, tmp_path):
    extra = readme_extra_config()
    operator_list = pod_addresses(chart_cluster(len(pods)))
    # the operator's pod i is the StatefulSet's pod i: its DNS name resolves to it
    resolve = {PodAddress.parse(a).host: f"127.0.0.1:{pod.data_port}" for a, pod in zip(operator_list, pods,
                                                                                         strict=True)}
    token_file = tmp_path / "pod-tokens"
    token_file.write_text(f"{extra['tenant']} {pods[0].tokens['acme']}\n")
    cluster = tenant_stores([PodAddress.parse(a) for a in on_loopback(operator_list, resolve)],
                            {extra["tenant"]: pods[0].tokens["acme"]})[extra["tenant"]]
    config = dataclasses.replace(ConnectorConfig.from_extra(extra, served_model="/models/qwen3-8b"),
                                 pods=tuple(on_loopback(extra["pods"], resolve)), pod_token_file=str(token_file))
    connector = open_store(config)
    chunks = make_chunks(24, seed=3, tenant=extra["tenant"])
    try:
        for name, obj in chunks:
            cluster.put(name, obj)
        held = {pod_id: sum(pod_id in cluster.placement(name) for name, _ in chunks) for pod_id in cluster.pods}
        assert all(held.values()), held  # both pods hold some: a wrong id would send lookups astray
        found = [name for name, obj in chunks if connector.read(name) == obj]
        assert len(found) == len(chunks), f"{len(chunks) - len(found)} of {len(chunks)} chunks not found"
    finally:
        cluster.close()
        connector.close()
