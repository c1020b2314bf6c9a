"""Every metric the Grafana dashboard queries exists in the real services' /metrics: a storage pod, a stage
worker and the coordinator run as local processes (tiny model), serve one prompt twice (prefilled and
stored, then restored), and are scraped; the dashboard's PromQL is checked against what they export.
Names only: what each query returns, through a real Prometheus, is test_prometheus.py's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cacheflow_services.local_cluster import ClusterSpec, LocalCluster, start_cluster
from tests.k8s.checks import CHART
from tests.k8s.promql import metric_names, variable_metric

DASHBOARD = CHART / "dashboards" / "cacheflow.json"
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "summary": ("", "_sum", "_count", "_created")}
# What the issue asks the dashboard to show, by the series that carry it.
REQUIRED = {"cacheflow_ttft_seconds_bucket", "cacheflow_restore_seconds_bucket",
            "cacheflow_worker_compute_busy_seconds_total", "cacheflow_worker_channel_busy_seconds_total",
            "cacheflow_storage_read_bytes_total", "cacheflow_storage_link_capacity_bytes_per_second",
            "cacheflow_restored_token_layers_total", "cacheflow_queue_depth", "cacheflow_misses_total",
            "cacheflow_stage_loaded_bytes_total", "cacheflow_restore_loaded_share_bucket",
            "cacheflow_restore_meeting_point_bucket", "cacheflow_stage_restore_units_total",
            "cacheflow_storage_backend_info", "cacheflow_restore_time_share_bucket",
            "cacheflow_restore_recompute_predicted_seconds_total", "cacheflow_stage_unused_bytes_total"}


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in board["panels"] for t in p.get("targets", [])]


def dashboard_metrics() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    names = set().union(*(metric_names(q) for q in dashboard_queries()))
    for var in board["templating"]["list"]:
        if isinstance(var.get("query"), dict):
            names |= variable_metric(var["query"]["query"])
    return names


def exported(text: str) -> set[str]:
    """The series names an exposition declares: samples seen, and every name a declared family can have
    (a labelled counter has no sample before its first increment, but its family is declared)."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {s.name for s in family.samples}
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    return names


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    spec = ClusterSpec(model="tiny", stages=1, pods=1, chunk_size=32, dtype="float32", policy="cake", port=0,
                       transport="tcp", threads_per_stage=1, rate_gbps=1.0)
    started = start_cluster(spec, tmp_path_factory.mktemp("cluster"))
    yield started
    started.stop()


def scrape(cluster: LocalCluster) -> dict[str, str]:
    pod = cluster.pods[0]
    urls = {"coordinator": cluster.coordinator.url, "worker": cluster.workers[0].url,
            "storage": f"http://127.0.0.1:{pod.http_port}"}
    return {name: httpx.get(f"{url}/metrics", timeout=30).text for name, url in urls.items()}


def complete(cluster: LocalCluster, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(f"{cluster.coordinator.url}/v1/completions", timeout=300,
                   headers={"Authorization": f"Bearer {cluster.token}"},
                   json={"model": "tiny", "prompt": prompt, "max_tokens": 2})
    r.raise_for_status()
    body: dict[str, Any] = r.json()
    return body


def test_every_dashboard_metric_is_exported_by_the_real_services(cluster):
    import time

    prompt = [(7 * i + 3) % 1000 for i in range(100)]
    complete(cluster, prompt)  # prefilled, and its chunks stored in the background
    time.sleep(1.0)
    restored = complete(cluster, prompt)
    assert restored["cacheflow"]["prompt_tokens_restored"] > 0, "the second request did not restore"
    scraped = scrape(cluster)
    available = set().union(*(exported(text) for text in scraped.values()))
    missing = sorted(dashboard_metrics() - available)
    assert missing == [], f"the dashboard queries metrics no service exports: {missing}"
    assert dashboard_metrics() >= REQUIRED
    # the restore really fed the utilisation series (not only their declarations)
    busy = next(line for line in scraped["worker"].splitlines()
                if line.startswith("cacheflow_worker_compute_busy_seconds_total "))
    assert float(busy.split()[1]) > 0
    assert 'cacheflow_worker_channel_busy_seconds_total{channel="0"}' in scraped["worker"]
    assert "cacheflow_storage_read_bytes_total" in scraped["storage"]


@pytest.mark.parametrize(("expr", "names"), [
    ('histogram_quantile(0.9, sum by (le, service) (rate(a_bucket{ns="$namespace"}[$__rate_interval])))',
     {"a_bucket"}),
    ("sum by (pod) (rate(read_total[5m])) / on (pod) (max by (pod) (link_rate) > 0)", {"read_total", "link_rate"}),
    ('sum by (how) (rate(x_total[1m])) / ignoring (how) group_left sum(rate(x_total[1m]))', {"x_total"}),
    ('label_replace(up{job="a"}, "dst", "$1", "src", "(.*)") * 1e3 offset 5m', {"up"}),
    ("sum(rate(requests_total[5m])) without (instance) and on() vector(1)", {"requests_total"}),
])
def test_the_metric_name_extractor(expr, names):
    assert metric_names(expr) == names


def test_variables_read_their_metric():
    assert variable_metric('label_values(cacheflow_queue_depth{namespace="$namespace"}, cacheflow_io_cluster)') == \
        {"cacheflow_queue_depth"}
    assert variable_metric("label_values(namespace)") == set()


def test_exported_names_cover_declared_families():
    text = "# HELP m_total x\n# TYPE m_total counter\n# HELP h y\n# TYPE h histogram\n# TYPE g gauge\ng 1.0\n"
    assert {"m_total", "h_bucket", "h_sum", "h_count", "g"} <= exported(text)
    assert "m" not in exported(text) and "h" not in exported(text)


def test_the_dashboard_is_self_contained():
    board = json.loads(DASHBOARD.read_text())
    assert board["uid"] == "cacheflow" and board["title"] == "CacheFlow"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    sources = {t["datasource"]["uid"] for p in board["panels"] for t in p.get("targets", [])}
    assert sources == {"${datasource}"}, "every query goes to the data source the user picks"
