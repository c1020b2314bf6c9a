"""The operator's manifest builders (pure): valid for the Kubernetes API, owned by the resource, and wired
so that every pod runs a `cacheflow` command line that parses and names objects that exist."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from cacheflow_common.errors import ConfigError
from cacheflow_common.layer_split import balanced_split
from cacheflow_operator.manifests.build import children
from cacheflow_operator.manifests.common import quantity
from cacheflow_operator.spec import API_VERSION, KIND, Cluster
from cacheflow_services.local_cluster import ClusterSpec
from tests.k8s.checks import by_kind, check_wiring, container, validate_all, validate_cr

DEFAULT: dict[str, Any] = {}
BIG = {  # non-default: 4 stages with GPUs and an explicit split, 3 storage pods, models from a volume
    "model": {"source": "/models/qwen3-8b", "dtype": "bfloat16", "layers": 36, "volumeClaim": "models"},
    "stages": {"count": 4, "layerSplit": "0:8,8:18,18:28,28:36", "gpus": 2, "policy": "cake",
               "profileConfigMap": "h100-profile", "nodeSelector": {"gpu": "h100"},
               "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
               "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"cpu": "7500m"}}},
    "storage": {"pods": 3, "volumeSize": "500Gi", "storageClass": "fast", "linkRateGbps": 40, "chunkReplicas": 2,
                "transport": "tcp", "deleteVolumes": True},
    "coordinator": {"replicas": 2, "batching": {"maxBatch": 16, "maxQueue": 128, "windowMs": 5},
                    "serviceType": "LoadBalancer"},
}
REDIS = {"storage": {"backend": "redis", "redisUrl": "redis://redis.cache.svc:6379/0", "pods": 1}}


def resource(spec: dict[str, Any], name: str = "demo") -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name, "namespace": "ml", "uid": "uid-1"},
            "spec": spec}


@pytest.mark.parametrize("spec", [DEFAULT, BIG, REDIS], ids=["default", "4-stages-3-pods-gpus", "redis"])
def test_children_are_valid_owned_and_wired(spec):
    validate_cr(resource(spec))
    cluster = Cluster.from_resource(resource(spec))
    objs = children(cluster)
    validate_all(objs)
    for obj in objs:
        assert obj["metadata"]["ownerReferences"] == [{"apiVersion": API_VERSION, "kind": KIND, "name": "demo",
                                                       "uid": "uid-1", "controller": True,
                                                       "blockOwnerDeletion": True}]
        assert obj["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "cacheflow-operator"
    parsed = check_wiring(objs, cluster.spec.model.layers)
    assert sorted(a.command for a in parsed.values()) == \
        sorted(["coordinator", "storage", *["worker"] * cluster.spec.stages.count])


def test_the_default_split_is_balanced_split():
    cluster = Cluster.from_resource(resource({"model": {"layers": 30}, "stages": {"count": 4}}))
    layers = [a.layers for a in check_wiring(children(cluster), 30).values() if a.command == "worker"]
    assert sorted(layers, key=lambda s: int(s.split(":")[0])) == \
        [f"{r.start}:{r.stop}" for r in balanced_split(30, 4)]


def test_non_default_resources_reach_the_pods():
    objs = children(Cluster.from_resource(resource(BIG)))
    args = check_wiring(objs, 36)
    stage = by_kind(objs, "Deployment")["demo-stage-2"]
    pod = stage["spec"]["template"]["spec"]
    assert container(stage)["resources"]["limits"] == {"cpu": "7500m", "nvidia.com/gpu": 2}
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    worker = args["demo-stage-2"]
    assert (worker.layers, worker.threads, worker.replicas, worker.policy) == ("18:28", 7, 2, "cake")
    assert worker.profile == "/etc/cacheflow/profile/profile.json" and worker.model == "/models/qwen3-8b"
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in container(stage)["volumeMounts"]
    sts = by_kind(objs, "StatefulSet")["demo-storage"]
    claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["storageClassName"] == "fast" and claim["resources"]["requests"]["storage"] == "500Gi"
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"
    storage = args["demo-storage"]
    assert (storage.rate_gbps, storage.transport, storage.dir) == (40.0, "tcp", "/data")
    assert int(storage.capacity) == int(quantity("500Gi") * 0.9)
    coordinator = args["demo-coordinator"]
    assert (coordinator.max_batch, coordinator.max_queue, coordinator.batch_window_ms) == (16, 128, 5.0)
    assert by_kind(objs, "Service")["demo-coordinator"]["spec"]["type"] == "LoadBalancer"


def secret_items(obj: dict[str, Any]) -> dict[str, list[str]]:
    """The Secret keys each of the pod's volumes projects, by Secret name; the mounts are read-only."""
    pod = obj["spec"]["template"]["spec"]
    mounts = {m["name"]: m for m in container(obj)["volumeMounts"]}
    items = {}
    for v in pod["volumes"]:
        if "secret" in v:
            assert mounts[v["name"]]["readOnly"] is True
            items[v["secret"]["secretName"]] = sorted(i["key"] for i in v["secret"]["items"])
    return items


@pytest.mark.parametrize("spec", [DEFAULT, BIG], ids=["default", "4-stages-3-pods-gpus"])
def test_each_pod_mounts_only_its_secrets(spec):
    """The coordinator alone holds the grant signing key and the clients' tokens; workers hold the internal token
    and the verifying key but no storage token; storage pods hold their tokens and nothing internal. With TLS
    (on by default) every pod trusts the CA and the servers (workers, pods) hold the certificate; no pod holds the
    CA's key (the operator alone reads it, to renew the certificate)."""
    objs = children(Cluster.from_resource(resource(spec)))
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    mounted = {name: secret_items(obj) for name, obj in workloads.items()}
    server = {"demo-tls": ["ca.crt", "tls.crt", "tls.key"]}
    assert mounted.pop("demo-coordinator") == {"cacheflow-auth": ["api-tokens", "pod-tokens"],
                                               "demo-internal": ["grant-signing-key.pem", "internal-token"],
                                               "demo-tls": ["ca.crt"]}
    assert mounted.pop("demo-storage") == {"cacheflow-auth": ["pod-tokens"], **server}
    assert len(mounted) == cluster_stages(spec)
    for name, secrets in mounted.items():
        assert secrets == {"demo-internal": ["grant-verify-key.pem", "internal-token"], **server}, name
        args = container(workloads[name])["args"]
        assert "--pod-token-file" not in args and "--token-file" not in args
    plain = children(Cluster.from_resource(resource({**spec, "tls": {"enabled": False}})))
    assert not any("demo-tls" in secret_items(obj) for obj in [*by_kind(plain, "Deployment").values(),
                                                                 *by_kind(plain, "StatefulSet").values()])


def cluster_stages(spec: dict[str, Any]) -> int:
    return int(Cluster.from_resource(resource(spec)).spec.stages.count)


def test_workers_bind_their_pod_ip():
    objs = children(Cluster.from_resource(resource(BIG)))
    for name, obj in by_kind(objs, "Deployment").items():
        args = check_wiring(objs, 36)[name]
        if args.command == "worker":
            assert args.host == "$(POD_IP)"
            assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}} \
                in container(obj)["env"]
        else:
            assert args.host == "0.0.0.0"  # the coordinator's API is reached through its Service by clients


def test_the_link_capacity_reaches_the_storage_pods_only_when_set():
    default = check_wiring(children(Cluster.from_resource(resource(DEFAULT))), 30)["demo-storage"]
    assert default.link_capacity_gbps == 0.0
    args = container(by_kind(children(Cluster.from_resource(resource(DEFAULT))), "StatefulSet")["demo-storage"])["args"]
    assert "--link-capacity-gbps" not in args
    spec = {"storage": {"linkRateGbps": 10, "linkCapacityGbps": 100}}
    validate_cr(resource(spec))
    storage = check_wiring(children(Cluster.from_resource(resource(spec))), 30)["demo-storage"]
    assert (storage.rate_gbps, storage.link_capacity_gbps) == (10.0, 100.0)


def test_the_config_map_is_a_spec_cacheflow_up_runs(tmp_path):
    objs = children(Cluster.from_resource(resource(BIG)))
    data = by_kind(objs, "ConfigMap")["demo-spec"]["data"]
    (tmp_path / "cluster.yaml").write_text(data["cluster.yaml"])
    spec = ClusterSpec.load(tmp_path / "cluster.yaml")  # the same loader `cacheflow up --spec` uses
    assert (spec.model, spec.stages, spec.pods, spec.max_batch, spec.rate_gbps) == ("/models/qwen3-8b", 4, 3, 16, 40.0)
    layout = yaml.safe_load(data["layout.yaml"])
    assert [s["layers"] for s in layout["stages"]] == ["0:8", "8:18", "18:28", "28:36"]
    assert layout["endpoint"] == "http://demo-coordinator.ml.svc:8000"


@pytest.mark.parametrize(("spec", "name", "error"), [
    ({"stages": {"count": 3, "layerSplit": "0:10,10:30"}}, "demo", "has 2 stages, stages.count is 3"),
    ({"stages": {"count": 2, "layerSplit": "0:10,12:30"}}, "demo", "must tile layers [0, 30)"),
    ({"model": {"layers": 2}, "stages": {"count": 3}}, "demo", "cannot split 2 layers into 3 stages"),
    ({"storage": {"backend": "redis"}}, "demo", "needs storage.redisUrl"),
    ({"storage": {"pods": 1, "chunkReplicas": 2}}, "demo", "chunkReplicas 2 > storage.pods 1"),
    ({"storage": {"backend": "redis", "redisUrl": "redis://r:6379/0", "capacity": "1GiB"}}, "demo", "maxmemory"),
    ({"stages": {"cont": 2}}, "demo", "spec.stages: unknown keys ['cont']"),
    ({"stages": {"count": "2"}}, "demo", "spec.stages.count must be an integer, not '2'"),
    ({"image": {"pullSecrets": ["a", 3]}}, "demo", "spec.image.pullSecrets[1] must be a string, not 3"),
    ({}, "a" * 41, "at most 40"),
    ({}, "Demo", "lowercase"),
])
def test_bad_specs_are_refused_with_the_reason(spec, name, error):
    with pytest.raises(ConfigError) as caught:
        Cluster.from_resource(resource(spec, name))
    assert error in str(caught.value)


def test_the_crd_schema_refuses_what_the_api_server_would():
    import jsonschema

    for bad in ({"stages": {"count": 0}}, {"storage": {"backend": "s3"}}, {"storage": {"volumeSize": "lots"}},
                {"model": {"layers": "30"}}, {"stages": {"layerSplit": "0-15"}}):
        with pytest.raises(jsonschema.ValidationError):
            validate_cr(resource(bad))
