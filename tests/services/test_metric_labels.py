"""No metric of the coordinator, a stage worker or a storage pod has a label named like one a scrape
attaches to its target (Prometheus's `job` and `instance`, the Prometheus Operator's `namespace`,
`service`, `pod`, `container`, `endpoint` and the ServiceMonitor's target labels): the scrape would rename
it `exported_<name>` and aggregations by that name would fold every series into one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from cacheflow_services.coordinator.metrics import ROUTES, CoordinatorMetrics
from cacheflow_services.scrape_config import RESERVED, Target, operator_labels, scrape_config
from cacheflow_services.storage.metrics import StorageMetrics
from cacheflow_services.worker.metrics import WorkerMetrics


def label_names(registry: CollectorRegistry) -> dict[str, set[str]]:
    """metric family -> the label names of its samples (`le` of histograms aside)."""
    return {family.name: {k for s in family.samples for k in s.labels if k != "le"} for family in registry.collect()}


def test_no_metric_label_is_a_target_label():
    coordinator = CoordinatorMetrics()
    coordinator.declare(2, ["pod-0", "pod-1"])  # labelled series exist from start-up: their labels are visible
    coordinator.pod_up.labels("pod-0").set(1)  # as the /metrics handler sets them
    coordinator.requests.labels(ROUTES["chat"], "200").inc()
    registries = {"coordinator": coordinator.registry, "worker": WorkerMetrics(n_channels=2).registry,
                  "storage": StorageMetrics().registry}
    clashes = {f"{process} {metric}: {sorted(labels & RESERVED)}" for process, registry in registries.items()
               for metric, labels in label_names(registry).items() if labels & RESERVED}
    assert clashes == set()
    assert label_names(coordinator.registry)["cacheflow_pod_up"] == {"storage_pod"}
    assert label_names(coordinator.registry)["cacheflow_requests"] == {"route", "status"}


def test_the_reserved_names_are_every_label_a_target_gets():
    labels = operator_labels(Target("127.0.0.1:1", "c-stage-0", "c-stage-0-0", "worker", {"cacheflow.io/cluster": "c"}))
    assert set(labels) | {"instance"} == RESERVED


def test_workers_serving_tls_are_scraped_over_it_as_the_chart_scrapes_them():
    plain = Target("127.0.0.1:1", "c-storage", "c-storage-0", "storage")
    tls = Target("127.0.0.1:2", "c-stage-0", "c-stage-0-0", "worker", endpoint="https")
    jobs = {job["job_name"]: job for job in scrape_config([plain, tls])["scrape_configs"]}
    assert jobs["c-stage-0"]["scheme"] == "https" and jobs["c-stage-0"]["tls_config"] == {"insecure_skip_verify": True}
    assert "scheme" not in jobs["c-storage"]  # http, Prometheus's default
    assert jobs["c-stage-0"]["static_configs"][0]["labels"]["endpoint"] == "https"
