"""A real storage pod's gauges say what it holds and what its link is: objects and bytes stored (also
those written before a restart, with or without a capacity), its backend, its link capacity."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.services.chunks import make_chunks
from tests.services.procs import Pod, start_pod


def gauges(pod: Pod) -> dict[str, float]:
    """Every unlabelled sample of the pod's /metrics, and `name{labels}` for labelled ones."""
    text = httpx.get(pod.url("/metrics"), timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def put_all(pod: Pod, chunks: list[tuple[str, bytes]]) -> None:
    client = pod.client()
    for name, obj in chunks:
        client.put(name, obj)


def test_objects_and_bytes_count_what_is_stored_also_after_a_restart(tmp_path):
    chunks = make_chunks(12, seed=11)
    stored = sum(len(obj) for _, obj in chunks)
    pod = start_pod(tmp_path)  # no capacity: no LRU index keeps count
    try:
        assert gauges(pod)["cacheflow_storage_objects"] == 0
        put_all(pod, chunks[:5])
        assert gauges(pod)["cacheflow_storage_objects"] == 5  # as objects are written
        put_all(pod, chunks[5:])
        pod.stop()
        pod.start()  # the same directory and ports: the objects are still there
        found = gauges(pod)
        assert found["cacheflow_storage_objects"] == 12
        assert found["cacheflow_storage_used_bytes"] == stored
        pod.client().delete(chunks[0][0])
        assert gauges(pod)["cacheflow_storage_objects"] == 11
    finally:
        pod.stop()


def test_with_a_capacity_the_lru_index_counts_them(tmp_path):
    chunks = make_chunks(4, seed=12)
    pod = start_pod(tmp_path, "--capacity", "64MiB")
    try:
        put_all(pod, chunks)
        pod.stop()
        pod.start()
        assert gauges(pod)["cacheflow_storage_objects"] == 4
    finally:
        pod.stop()


def test_the_link_capacity_defaults_to_the_shaping_rate(tmp_path):
    shaped = start_pod(tmp_path / "shaped", "--rate-gbps", "8", backend="memory")
    given = start_pod(tmp_path / "given", "--link-capacity-gbps", "100", backend="memory")
    try:
        assert gauges(shaped)["cacheflow_storage_link_capacity_bytes_per_second"] == 1e9
        assert gauges(given)["cacheflow_storage_link_capacity_bytes_per_second"] == 12.5e9
        assert gauges(given)["cacheflow_storage_link_bytes_per_second"] == 0  # unshaped
        assert gauges(given)['cacheflow_storage_backend_info{backend="memory"}'] == 1
    finally:
        shaped.stop()
        given.stop()
