"""A Prometheus scrape configuration for a local cluster (`cacheflow up`) that gives every process the
labels the Helm chart's ServiceMonitor gives it on Kubernetes under the Prometheus Operator, so the
chart's Grafana dashboard works unchanged against `cacheflow up`.

The operator turns a ServiceMonitor endpoint into targets labelled `namespace`, `service`, `pod`,
`container`, `endpoint` (the port's name) and `job` (the Service's name), plus each of the
ServiceMonitor's `targetLabels` copied from the Service's labels (`cacheflow.io/cluster` becomes
`cacheflow_io_cluster`); `honor_labels` is off, so a scraped metric's own label of one of those names
would be renamed `exported_<name>` (CacheFlow's metrics have none). Services, pods and containers are
named as the CacheFlow operator names them for a cluster called `name`.

`cacheflow up` writes this file as `<cluster directory>/prometheus.yml`:
`prometheus --config.file=<that file>` scrapes the whole cluster.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from cacheflow_services.local_cluster import LocalCluster

PORT_NAME = "http"  # the ServiceMonitor's endpoint port (charts/cacheflow/templates/servicemonitor.yaml) ...
TLS_PORT_NAME = "https"  # ... and the one for the stage workers when they serve TLS
TARGET_LABELS = ("cacheflow.io/cluster",)  # its targetLabels
CLUSTER_LABEL = "cacheflow.io/cluster"  # the label every Service of a cluster carries (its name)
NAMESPACE = "local"  # what `namespace` reads for a local cluster
INTERVAL_S = 5.0
FILE_NAME = "prometheus.yml"


def prometheus_label(name: str) -> str:
    """A Kubernetes label name as the Prometheus Operator writes it (`cacheflow.io/cluster`: `cacheflow_io_cluster`)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


# Every label a scrape attaches to a target: Prometheus's own (job, instance) and the operator's; a metric's
# label of one of these names is renamed exported_<name> (honor_labels off).
RESERVED = frozenset({"job", "instance", "namespace", "service", "pod", "container", "endpoint"} |
                     {prometheus_label(key) for key in TARGET_LABELS})


@dataclass(frozen=True)
class Target:
    """One process to scrape, and the Kubernetes objects it stands for."""

    address: str  # host:port of its /metrics
    service: str
    pod: str
    container: str
    service_labels: Mapping[str, str] = field(default_factory=dict)
    endpoint: str = PORT_NAME  # the ServiceMonitor endpoint (port name) it is scraped through: http | https


def operator_labels(target: Target, *, namespace: str = NAMESPACE,
                    target_labels: Sequence[str] = TARGET_LABELS) -> dict[str, str]:
    """The labels the Prometheus Operator attaches to `target` (scraped through its endpoint)."""
    labels = {"namespace": namespace, "service": target.service, "pod": target.pod, "container": target.container,
              "endpoint": target.endpoint, "job": target.service}
    for key in target_labels:
        if key in target.service_labels:
            labels[prometheus_label(key)] = target.service_labels[key]
    return labels


def _host_port(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


def local_targets(cluster: LocalCluster, name: str = "local") -> list[Target]:
    """The coordinator, every stage worker and every storage pod, named as the operator names them."""
    labels = {CLUSTER_LABEL: name}
    targets = [Target(_host_port(cluster.coordinator.url), f"{name}-coordinator", f"{name}-coordinator-0",
                      "coordinator", labels)]
    targets += [Target(_host_port(w.url), f"{name}-stage-{w.stage}", f"{name}-stage-{w.stage}-0", "worker", labels,
                       TLS_PORT_NAME if w.tls else PORT_NAME) for w in cluster.workers]
    targets += [Target(f"127.0.0.1:{p.http_port}", f"{name}-storage", f"{name}-storage-{i}", "storage", labels)
                for i, p in enumerate(cluster.pods)]
    return targets


def scrape_config(targets: Sequence[Target], *, interval_s: float = INTERVAL_S, **labelling: Any) -> dict[str, Any]:
    """A prometheus.yml: one job per Service (as the operator makes them), `honor_labels` off."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    tls = {t.service for t in targets if t.endpoint == TLS_PORT_NAME}
    for t in targets:
        jobs.setdefault(t.service, []).append({"targets": [t.address], "labels": operator_labels(t, **labelling)})
    return {"global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
            "scrape_configs": [{"job_name": job, "metrics_path": "/metrics", "honor_labels": False,
                                **(_HTTPS if job in tls else {}), "static_configs": static}
                               for job, static in jobs.items()]}


# as the chart's ServiceMonitor scrapes TLS workers: /metrics holds no tenant data, the certificate is not checked
_HTTPS = {"scheme": "https", "tls_config": {"insecure_skip_verify": True}}


def write(cluster: LocalCluster, directory: Path, name: str = "local", *, interval_s: float = INTERVAL_S) -> Path:
    """`directory/prometheus.yml` for `cluster`; returns its path."""
    path = directory / FILE_NAME
    config = scrape_config(local_targets(cluster, name), interval_s=interval_s)
    path.write_text(f"# Written by `cacheflow up`: prometheus --config.file={path}\n"
                    + yaml.safe_dump(config, sort_keys=False))
    return path
