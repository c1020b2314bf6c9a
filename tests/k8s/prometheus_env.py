"""A real Prometheus (Debian's `prometheus`) scraping a real local cluster with the labels the chart's
ServiceMonitor gives its targets under the Prometheus Operator: the ServiceMonitor is rendered by the
real Helm engine, the Services and workloads it selects are the CacheFlow operator's own manifests for
the rendered CacheFlowCluster, and each local process stands for the pod those manifests would run."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import yaml

from cacheflow_operator.manifests.build import children
from cacheflow_operator.spec import KIND, Cluster
from cacheflow_services.local_cluster import LocalCluster
from cacheflow_services.local_process import free_port
from cacheflow_services.scrape_config import NAMESPACE, Target
from tests.k8s.checks import CHART

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
CLUSTER_NAME = "flow"  # the namespace is the one `cacheflow up` gives its processes
SCRAPE_S = 2.0
START_S = 60.0
Manifest = dict[str, Any]


@dataclass(frozen=True)
class Monitoring:
    """The rendered ServiceMonitor's target labels, and the local processes as targets (each with the
    endpoint the ServiceMonitor scrapes its Service through)."""

    target_labels: tuple[str, ...]
    targets: list[Target]


def render_chart(stages: int, pods: int, *, tls: bool) -> list[Manifest]:
    """`helm template` with the ServiceMonitor on and a CacheFlowCluster of `stages` stages and `pods` pods,
    with TLS on its internal hops or not."""
    values = {"metrics": {"serviceMonitor": {"enabled": True}},
              "cluster": {"name": CLUSTER_NAME, "spec": {"stages": {"count": stages}, "storage": {"pods": pods},
                                                         "tls": {"enabled": tls}}}}
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="cacheflow", namespace=NAMESPACE, is_install=True)
    return [doc for path, text in rendered.items() if path.endswith(".yaml") for doc in yaml.safe_load_all(text) if doc]


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def _workload(objs: list[Manifest], service: Manifest) -> Manifest:
    (found,) = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")
                and _selects(service["spec"]["selector"], o["spec"]["template"]["metadata"]["labels"])]
    return found


def _container(workload: Manifest, port_name: str) -> str:
    (name,) = [c["name"] for c in workload["spec"]["template"]["spec"]["containers"]
               if port_name in [p["name"] for p in c.get("ports", [])]]
    return str(name)


def monitoring(local: LocalCluster) -> Monitoring:
    """Every process of `local` as the target the ServiceMonitor makes of the pod it stands for."""
    rendered = render_chart(len(local.workers), len(local.pods), tls=local.workers[0].tls is not None)
    (monitor,) = [o for o in rendered if o["kind"] == "ServiceMonitor"]
    (resource,) = [o for o in rendered if o["kind"] == KIND]
    objs = children(Cluster.from_resource({**resource, "metadata": {**resource["metadata"], "uid": "u"}}))
    endpoints = {e["port"] for e in monitor["spec"]["endpoints"]}
    services = [s for s in objs if s["kind"] == "Service"
                and _selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    targets = []
    for service in services:
        workload, labels = _workload(objs, service), service["metadata"]["labels"]
        name = workload["metadata"]["name"]
        (port,) = [p["name"] for p in service["spec"]["ports"] if p["name"] in endpoints]  # scraped through
        for address, pod in _local_processes(local, labels, name):
            targets.append(Target(address, service["metadata"]["name"], pod, _container(workload, port), labels,
                                  port))
    return Monitoring(tuple(monitor["spec"]["targetLabels"]), targets)


def _local_processes(local: LocalCluster, labels: dict[str, str], workload: str) -> list[tuple[str, str]]:
    """(metrics address, pod name) of the local processes a Service stands for: the StatefulSet's pods
    `<name>-<i>`, a Deployment's one replica `<name>-0`."""
    component = labels["app.kubernetes.io/component"]
    if component == "storage":
        return [(f"127.0.0.1:{p.http_port}", f"{workload}-{i}") for i, p in enumerate(local.pods)]
    if component == "coordinator":
        return [(local.coordinator.url.split("://")[1], f"{workload}-0")]
    stage = int(labels["cacheflow.io/stage"])
    return [(local.workers[stage].url.split("://")[1], f"{workload}-0")]


class Prometheus:
    """A running Prometheus and its HTTP API."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc, self.url = proc, url

    def get(self, path: str, **params: str) -> Any:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", f"{path} {params}: {r.status_code} {body}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The instant vector `expr` evaluates to (now, or at `at`): [{"metric": labels, "value": [t, "v"]}]."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        data = self.get("/api/v1/query", **params)
        assert data["resultType"] == "vector", data
        return list(data["result"])

    def wait_for(self, expr: str, what: str, timeout_s: float = START_S) -> None:
        """Until `expr` returns a series (Prometheus has scraped what makes it true)."""
        deadline = time.monotonic() + timeout_s
        while not self.query(expr):
            assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what} ({expr})"
            time.sleep(0.5)


@contextlib.contextmanager
def running_prometheus(config_path: Path, directory: Path) -> Iterator[Prometheus]:
    """Prometheus on a free loopback port with the configuration in `config_path`, ready; killed (and waited
    for) afterwards."""
    url = f"http://127.0.0.1:{free_port()}"
    log = open(directory / "prometheus.log", "wb")  # noqa: SIM115 (closed below, after the process)
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={directory / 'tsdb'}",
                             f"--web.listen-address={url.split('://')[1]}"], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(proc, url, directory / "prometheus.log")
        yield Prometheus(proc, url)
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()


def _wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError(f"prometheus not ready within {START_S:.0f} s:\n{log.read_text()[-3000:]}")
