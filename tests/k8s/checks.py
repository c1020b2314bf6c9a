"""Offline checks of Kubernetes manifests: the API's own schemas (kubernetes-validate, strict: unknown
fields fail), the CRD's schema for CacheFlowCluster instances (jsonschema), and the wiring between
objects: every container's arguments parse with the real `cacheflow` parser, and the addresses they
name are Services and StatefulSet pods that exist, on ports that exist.
"""

from __future__ import annotations

import argparse
import functools
import itertools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate.utils as kv
import yaml

from cacheflow_common.transport.pod_client import PodAddress
from cacheflow_services.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "cacheflow"
K8S_VERSIONS = ("1.27", kv.latest_version())  # the chart's kubeVersion floor, and the newest schemas shipped
Manifest = dict[str, Any]


def validate_k8s(obj: Manifest) -> bool:
    """Strict validation against every version in K8S_VERSIONS; False for kinds it has no schema for."""
    for version in K8S_VERSIONS:
        try:
            kv.validate(obj, version, strict=True)
        except kv.SchemaNotFoundError:
            return False
        except kv.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            raise AssertionError(f"{obj['kind']} {obj['metadata'].get('name')} invalid for Kubernetes {version} "
                                 f"at {where}: {exc.message}") from exc
    return True


@functools.cache
def crd_schema() -> Manifest:
    crd = yaml.safe_load((CHART / "crds" / "cacheflowclusters.yaml").read_text())
    schema: Manifest = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def validate_cr(obj: Manifest) -> None:
    """A CacheFlowCluster against the CRD's openAPIV3Schema (what the API server checks on create)."""
    jsonschema.validate(obj, crd_schema())


def validate_all(objs: list[Manifest]) -> None:
    for obj in objs:
        if obj["kind"] == "CacheFlowCluster":
            validate_cr(obj)
        else:
            assert validate_k8s(obj), f"no schema for {obj['kind']}: check it by other means"


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The container's arguments through the real `cacheflow` parser: a misspelt flag fails here, and so
    does an abbreviated one (argparse would take `--pool-token` for `--pool-tokens`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags = subparsers.choices[args.command]._option_string_actions
    assert not (unknown := [f for f in argv if f.startswith("-") and f not in flags]), f"not exact flags: {unknown}"
    return args


def by_kind(objs: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def container(obj: Manifest) -> Manifest:
    (only,) = obj["spec"]["template"]["spec"]["containers"]
    c: Manifest = only
    return c


def selects(service: Manifest, workload: Manifest) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in service["spec"]["selector"].items())


def service_port(objs: list[Manifest], host: str, port: int, namespace: str) -> Manifest:
    """The Service `host` (<name>.<namespace>.svc) names, checked to expose `port`."""
    name, ns, svc = host.split(".")
    assert (ns, svc) == (namespace, "svc"), host
    service = by_kind(objs, "Service")[name]
    assert port in [p["port"] for p in service["spec"]["ports"]], f"{host}:{port} is not a port of the Service"
    return service


def mounted_secret_file(obj: Manifest, path: str) -> None:
    """`path` is a file of a Secret volume the container mounts."""
    spec = obj["spec"]["template"]["spec"]
    directory, _, key = path.rpartition("/")
    mount = next(m for m in container(obj)["volumeMounts"] if m["mountPath"] == directory)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert key in [item["path"] for item in volume["secret"]["items"]], f"{path} is not mounted"


def pod_ip_host(obj: Manifest) -> str:
    """A worker listens on its pod's IP: `--host $(POD_IP)`, the variable from the downward API's status.podIP."""
    (env,) = [e for e in container(obj)["env"] if e["name"] == "POD_IP"]
    assert env["valueFrom"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
    return "$(POD_IP)"


SECRET_FILES = ("token_file", "pod_token_file", "internal_token_file", "grant_key_file", "grant_signing_key_file")


def check_pods(objs: list[Manifest], addresses: str, namespace: str) -> None:
    """`--pods` names every storage pod once, by its stable StatefulSet DNS name, on its data port."""
    sts = by_kind(objs, "StatefulSet")
    parsed = [PodAddress.parse(a) for a in addresses.split(",")]
    for i, address in enumerate(parsed):
        pod, headless, ns, svc = address.host.split(".")
        statefulset = sts[pod.rsplit("-", 1)[0]]
        assert (ns, svc, pod) == (namespace, "svc", f"{statefulset['metadata']['name']}-{i}")
        assert statefulset["spec"]["serviceName"] == headless
        service = service_port(objs, f"{headless}.{ns}.svc", address.port, namespace)
        assert service["spec"]["clusterIP"] == "None" and selects(service, statefulset)
    assert len(parsed) == sum(s["spec"]["replicas"] for s in sts.values())


def check_wiring(objs: list[Manifest], n_layers: int) -> dict[str, argparse.Namespace]:
    """Every workload's command line, checked against the objects around it; returns them by workload name."""
    namespace = objs[0]["metadata"]["namespace"]
    parsed: dict[str, argparse.Namespace] = {}
    workloads = {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}
    for name, obj in workloads.items():
        args = parsed[name] = parse_args(container(obj)["args"])
        ports = {p["name"]: p["containerPort"] for p in container(obj)["ports"]}
        assert args.http_port == ports.get("https" if args.command == "worker" and args.tls_dir else "http")
        assert args.host == (pod_ip_host(obj) if args.command == "worker" else "0.0.0.0"), name
        assert any(selects(s, obj) for s in by_kind(objs, "Service").values()), f"no Service selects {name}"
        for secret_file in SECRET_FILES:
            if getattr(args, secret_file, None):
                mounted_secret_file(obj, getattr(args, secret_file))
        if getattr(args, "tls_dir", ""):  # every TLS pod trusts the CA; a server holds its certificate and key too
            for name in ("ca.crt", *(("tls.crt", "tls.key") if args.command != "coordinator" else ())):
                mounted_secret_file(obj, f"{args.tls_dir}/{name}")
    workers = sorted(((n, a) for n, a in parsed.items() if a.command == "worker"), key=lambda na: na[1].stage)
    assert [a.stage for _, a in workers] == list(range(len(workers)))
    bounds = [tuple(map(int, a.layers.split(":"))) for _, a in workers]
    assert bounds[0][0] == 0 and bounds[-1][1] == n_layers
    assert all(b[1] == c[0] for b, c in itertools.pairwise(bounds)), bounds
    urls = [url_of(objs, workloads[name], namespace) for name, _ in workers]  # each stage's Service
    for (_, worker), next_url in zip(workers, [*urls[1:], ""], strict=True):
        assert worker.next_stage == next_url
        check_pods(objs, worker.pods, namespace)
    for coordinator in (a for a in parsed.values() if a.command == "coordinator"):
        assert coordinator.stages.split(",") == urls
        check_pods(objs, coordinator.pods, namespace)
    return parsed


def url_of(objs: list[Manifest], workload: Manifest, namespace: str) -> str:
    """The URL of the one Service in front of `workload`, on its `http` (or `https`) port."""
    (service,) = [s for s in by_kind(objs, "Service").values() if selects(s, workload)]
    scheme, port = next((p["name"], p["port"]) for p in service["spec"]["ports"] if p["name"] in ("http", "https"))
    return f"{scheme}://{service['metadata']['name']}.{namespace}.svc:{port}"
