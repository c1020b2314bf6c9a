"""Every panel and variable of the Grafana dashboard, evaluated by a real Prometheus that scrapes a real
local cluster (2 stages, 2 storage pods, tiny model) with the labels the chart's ServiceMonitor gives
its targets (`prometheus_env`), while the cluster lives through what the dashboard shows: a healthy
start, restores, a miss (corrupt chunks), a stage that fails to restore, a storage pod killed.

Each query must return the series it is meant to, by the labels it groups on (one per pod, per stage,
per cause), with values that make sense; a metric label named like a target label would be renamed
`exported_<name>` by the scrape and fold series together, so none may be.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from cacheflow_services import scrape_config
from cacheflow_services.coordinator.metrics import MISS_CAUSES, ROUTES, STAGE_FAILURES
from cacheflow_services.local_cluster import ClusterSpec, LocalCluster, start_cluster
from cacheflow_services.scrape_config import operator_labels
from tests.k8s.checks import CHART
from tests.k8s.prometheus_env import (
    CLUSTER_NAME,
    NAMESPACE,
    PROMETHEUS,
    SCRAPE_S,
    Prometheus,
    monitoring,
    running_prometheus,
)
from tests.reliability.up_cluster import CHUNK, tiny_profile

pytestmark = pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK),
                                reason="no `prometheus` binary: install Debian's `prometheus` package (.ci/run does)")

DASHBOARD = CHART / "dashboards" / "cacheflow.json"
STAGES, PODS = 2, 2
RATE_WINDOW = "5m"  # what $__rate_interval stands for: longer than the whole test
WAIT_S = 60.0
Values = dict[tuple[str, ...], float]


@dataclass(frozen=True)
class Expect:
    """The series a query must return, as the values of the labels `by` (exactly these, or at least
    these), and a check of their values."""

    series: AbstractSet[tuple[str, ...]]
    by: tuple[str, ...] = ()
    at_least: bool = False
    values: Callable[[Values], bool] = lambda v: all(math.isfinite(x) and x >= 0 for x in v.values())


def positive(v: Values) -> bool:
    return all(math.isfinite(x) and x > 0 for x in v.values())


def shares(v: Values) -> bool:
    return all(0 <= x <= 1 for x in v.values())


def some_positive(v: Values) -> bool:
    return all(math.isfinite(x) and x >= 0 for x in v.values()) and max(v.values()) > 0


def all_equal(value: float) -> Callable[[Values], bool]:
    return lambda v: all(x == value for x in v.values())


ONE = {()}
STAGE_IDS = {(str(s),) for s in range(STAGES)}
STAGE_SERVICES = {(f"{CLUSTER_NAME}-stage-{s}",) for s in range(STAGES)}
STORAGE_PODS = {(f"{CLUSTER_NAME}-storage-{i}",) for i in range(PODS)}
POD_IDS = {(f"pod-{i}",) for i in range(PODS)}
FAILURES = {(f"stage{s}:{what}",) for s in range(STAGES) for what in STAGE_FAILURES}
READ_RESULTS = {("hit",), ("miss",), ("corrupt",)}

# (panel title, refId) -> what its query returns once the cluster has restored, missed and failed.
EXPECT: dict[tuple[str, str], Expect] = {
    ("TTFT percentiles", "A"): Expect(ONE, values=positive),
    ("TTFT percentiles", "B"): Expect(ONE, values=positive),
    ("TTFT percentiles", "C"): Expect(ONE, values=positive),
    ("Restore time", "A"): Expect(ONE, values=positive),
    ("Restore time", "B"): Expect(ONE, values=positive),
    ("Restore time", "C"): Expect(STAGE_SERVICES, ("service",), values=positive),
    ("Queue depth", "A"): Expect(ONE),
    ("Queue depth", "B"): Expect(ONE),
    ("Requests by status", "A"): Expect({(route, "200") for route in ROUTES.values()}, ("route", "status"),
                                        at_least=True, values=lambda v: v[(ROUTES["completions"], "200")] > 0),
    ("Queue wait and batch size", "A"): Expect(ONE, values=positive),
    ("Queue wait and batch size", "B"): Expect(ONE, values=lambda v: v[()] >= 1),
    ("Stage workers up", "A"): Expect(STAGE_IDS, ("stage",), values=all_equal(1)),
    ("Storage pods up", "A"): Expect(POD_IDS, ("storage_pod",), values=all_equal(1)),
    ("Compute loop busy per stage", "A"): Expect(STAGE_SERVICES, ("service",), values=some_positive),
    ("Storage channels busy per stage", "A"): Expect(STAGE_SERVICES, ("service",), values=some_positive),
    ("I/O utilisation per storage pod", "A"): Expect(STORAGE_PODS, ("pod",),
                                                     values=lambda v: shares(v) and some_positive(v)),
    ("Storage pod reads (bytes/s per pod)", "A"): Expect(STORAGE_PODS, ("pod",), values=some_positive),
    ("Storage pod reads (bytes/s per pod)", "B"): Expect(READ_RESULTS, ("result",),
                                                         values=lambda v: v[("corrupt",)] > 0 and v[("hit",)] > 0),
    ("Recomputed vs loaded share", "A"): Expect({("computed",), ("loaded",)}, ("how",),
                                                values=lambda v: shares(v) and abs(sum(v.values()) - 1) < 1e-6),
    ("Prompt tokens by source", "A"): Expect({("restored",), ("prefilled",)}, ("source",), values=positive),
    ("Misses by cause", "A"): Expect({(c,) for c in MISS_CAUSES}, ("cause",), at_least=True,
                                     values=lambda v: v[("absent",)] > 0),
    ("Failures by cause", "A"): Expect(FAILURES, ("cause",), at_least=True,
                                       values=lambda v: v[("stage1:restore-recomputed",)] > 0),
    ("I/O per stage (loaded bytes/s)", "A"): Expect(STAGE_IDS, ("stage",), values=some_positive),
    ("Storage reads by backend", "A"): Expect({("filesystem", r) for (r,) in READ_RESULTS}, ("backend", "result"),
                                              values=some_positive),
    ("Storage reads by backend", "B"): Expect({("filesystem",)}, ("backend",), values=positive),
    ("Loaded share per restore (p50)", "A"): Expect(STAGE_IDS, ("stage",), values=shares),
    ("Meeting point (p50)", "A"): Expect(STAGE_IDS, ("stage",), values=shares),
    ("Restore units by side", "A"): Expect({(s, h) for (s,) in STAGE_IDS for h in ("computed", "loaded", "missed")},
                                           ("stage", "how"), values=some_positive),
    ("Time saved vs whole recompute", "A"): Expect(ONE, values=lambda v: math.isfinite(v[()])),
    ("Time saved vs whole recompute", "B"): Expect(ONE, values=positive),
    ("Loaded bytes unused per stage", "A"): Expect(STAGE_IDS, ("stage",)),
    ("Units given to I/O by request class", "A"): Expect({("cake",), ("load-only",)}, ("policy",),
                                                         values=lambda v: shares(v) and v[("load-only",)] == 1),
}
# Before anything went wrong: every known cause is there, at 0 (not "no data").
HEALTHY = {
    ("Misses by cause", "A"): Expect({(c,) for c in MISS_CAUSES}, ("cause",), at_least=True, values=all_equal(0)),
    ("Failures by cause", "A"): Expect(FAILURES, ("cause",), at_least=True, values=all_equal(0)),
}
POD_KILLED = {("Storage pods up", "A"): Expect(POD_IDS, ("storage_pod",),
                                               values=lambda v: v == {("pod-0",): 1.0, ("pod-1",): 0.0})}


def panel_queries() -> dict[tuple[str, str], str]:
    board = json.loads(DASHBOARD.read_text())
    return {(p["title"], t["refId"]): t["expr"] for p in board["panels"] for t in p.get("targets", [])}


def resolve(expr: str) -> str:
    """The query as Grafana sends it for this namespace and cluster."""
    return (expr.replace("$__rate_interval", RATE_WINDOW).replace("$namespace", NAMESPACE)
            .replace("$cluster", CLUSTER_NAME))


def check(prom: Prometheus, expected: dict[tuple[str, str], Expect], at: float) -> None:
    queries = panel_queries()
    for key, expect in expected.items():
        result = prom.query(resolve(queries[key]), at)
        values = {tuple(s["metric"].get(label, "") for label in expect.by): float(s["value"][1]) for s in result}
        assert len(values) == len(result), f"{key}: series fold into one another by {expect.by}: {result}"
        found = set(values)
        assert (found >= expect.series if expect.at_least else found == expect.series), \
            f"{key}: series {sorted(found)}, expected {sorted(expect.series)}; query {queries[key]}"
        assert expect.values(values), f"{key}: values {values}; query {queries[key]}"


# ------------------------------------------------------------------------------------------ the cluster
@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    profile = tiny_profile(tmp_path_factory.mktemp("profile"))  # what "time saved" is predicted from
    spec = ClusterSpec(model="tiny", stages=STAGES, pods=PODS, chunk_size=CHUNK, dtype="float32", policy="cake",
                       profile=str(profile), port=0, transport="tcp", threads_per_stage=1, max_batch=4,
                       batch_window_ms=10)  # unshaped, no link capacity given: I/O utilisation still has one
    started = start_cluster(spec, tmp_path_factory.mktemp("cluster"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def client(local: LocalCluster) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=local.coordinator.url, headers={"Authorization": f"Bearer {local.token}"},
                      timeout=WAIT_S) as c:
        yield c


def objects(local: LocalCluster) -> set[Path]:
    roots = {Path(p.log_path).parent for p in local.pods}
    return {f for root in roots for f in root.rglob("*.L*") if f.is_file()}


def complete(client: httpx.Client, prompt: list[int], **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def store_and_restore(client: httpx.Client, prompt: list[int]) -> None:
    """Prefill (and store) `prompt`, then ask again until a request restores it (its chunks are saved in
    the background)."""
    complete(client, prompt)
    deadline = time.monotonic() + WAIT_S
    while complete(client, prompt)["cacheflow"]["prompt_tokens_restored"] == 0:
        assert time.monotonic() < deadline, "the prompt's chunks were never restored"
        time.sleep(0.3)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a section's checksum fails: the pod answers CORRUPT and drops it
    path.write_bytes(bytes(data))


def cause_a_miss(local: LocalCluster, client: httpx.Client, prompt: list[int]) -> None:
    """Stage 0's chunks of a stored prompt corrupt, and a request that loads everything: each load misses."""
    before = objects(local)
    store_and_restore(client, prompt)
    for path in objects(local) - before:
        if ".kv.L0-" in path.name:
            flip_a_byte(path)
    complete(client, prompt, policy="load-only")


def fail_a_stage(local: LocalCluster, client: httpx.Client, prompt: list[int]) -> None:
    """Stage 1 can neither load its chunks (all corrupt) nor compute them (no boundary stored, and stage 0
    loads rather than computes): its restore fails, no part of the prefix is left to restore, and the
    prompt is prefilled whole."""
    before = objects(local)
    store_and_restore(client, prompt)
    new = objects(local) - before
    for path in new:
        if ".hidden." in path.name:
            path.unlink()
    for path in new:
        if ".kv.L" in path.name and ".kv.L0-" not in path.name:
            flip_a_byte(path)
    assert complete(client, prompt, policy="load-only")["cacheflow"]["prompt_tokens_restored"] == 0


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300) for _ in range(4 * CHUNK + 7)]


# ------------------------------------------------------------------------------------------ the test
def test_every_dashboard_query_returns_its_series_from_a_real_prometheus(local, client, tmp_path):
    setup = monitoring(local)
    config = scrape_config.write(local, tmp_path, CLUSTER_NAME, interval_s=SCRAPE_S)  # what `cacheflow up` writes
    jobs = yaml.safe_load(config.read_text())["scrape_configs"]
    written = {static["targets"][0]: static["labels"] for job in jobs for static in job["static_configs"]}
    derived = {t.address: operator_labels(t, namespace=NAMESPACE,
                                          target_labels=setup.target_labels) for t in setup.targets}
    assert written == derived, "`cacheflow up`'s scrape configuration no longer matches the chart and operator"
    assert all(job["honor_labels"] is False for job in jobs)
    with running_prometheus(config, tmp_path) as prom:
        prom.wait_for(f'count(up{{namespace="{NAMESPACE}"}} == 1) == {len(setup.targets)}', "every target scraped")
        store_and_restore(client, prompt(1))
        prom.wait_for('sum(cacheflow_stage_restore_units_total{how="loaded"}) > 0', "a restore scraped")
        check(prom, HEALTHY, time.time())
        check_variables(prom)
        cause_a_miss(local, client, prompt(2))
        fail_a_stage(local, client, prompt(3))
        prom.wait_for('cacheflow_failures_total{cause="stage1:restore-recomputed"} > 0', "the failed stage scraped")
        prom.wait_for('cacheflow_misses_total{cause="absent"} > 0', "the miss scraped")
        prom.wait_for('sum(cacheflow_storage_reads_total{result="corrupt"}) > 0', "the corrupt reads scraped")
        at = time.time()
        check(prom, EXPECT, at)
        assert set(panel_queries()) == set(EXPECT), "every panel query is checked"
        check_no_exported_labels(prom, at)
        local.pods[1].kill()
        prom.wait_for('cacheflow_pod_up{storage_pod="pod-1"} == 0', "the killed pod seen down")
        check(prom, POD_KILLED, time.time())


def check_variables(prom: Prometheus) -> None:
    """The template variables, as Grafana's `label_values(metric{...}, label)` asks the label values API."""
    board = json.loads(DASHBOARD.read_text())
    expected = {"namespace": [NAMESPACE], "cluster": [CLUSTER_NAME]}
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        metric, label = resolve(var["query"]["query"])[len("label_values("):-1].rsplit(", ", 1)
        assert prom.get(f"/api/v1/label/{label}/values", **{"match[]": metric}) == expected[var["name"]], var


def check_no_exported_labels(prom: Prometheus, at: float) -> None:
    series = prom.get("/api/v1/series", **{"match[]": '{__name__=~"cacheflow_.+"}', "start": f"{at - 60:.3f}",
                                           "end": f"{at:.3f}"})
    clashes = sorted({f"{s['__name__']}: {k}" for s in series for k in s if k.startswith("exported_")})
    assert clashes == [], f"metric labels renamed by the scrape (named like a target label): {clashes}"
