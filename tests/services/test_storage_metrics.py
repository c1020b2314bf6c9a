"""A real storage pod's gauges say what it holds and what its link is: objects and bytes stored (also
those written before a restart, with or without a capacity), its backend, its link capacity (given, shaped,
the network interface's speed, or a stated default: never 0, so I/O utilisation has a denominator)."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cacheflow_services.storage.config import StorageConfig
from cacheflow_services.storage.metrics import DEFAULT_LINK_GBPS, link_capacity, nic_bytes_per_s
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


def test_the_link_capacity_defaults_to_the_shaping_rate_then_the_nic_then_10_gbit(tmp_path):
    shaped = start_pod(tmp_path / "shaped", "--rate-gbps", "8", backend="memory")
    given = start_pod(tmp_path / "given", "--link-capacity-gbps", "100", backend="memory")
    unshaped = start_pod(tmp_path / "unshaped", backend="memory")
    try:
        assert gauges(shaped)["cacheflow_storage_link_capacity_bytes_per_second"] == 1e9
        assert gauges(shaped)['cacheflow_storage_link_capacity_source_info{source="shaped"}'] == 1
        assert gauges(given)["cacheflow_storage_link_capacity_bytes_per_second"] == 12.5e9
        assert gauges(given)['cacheflow_storage_link_capacity_source_info{source="given"}'] == 1
        assert gauges(given)["cacheflow_storage_link_bytes_per_second"] == 0  # unshaped
        assert gauges(given)['cacheflow_storage_backend_info{backend="memory"}'] == 1
        # neither: this machine's interface speed, or the stated default where it reports none (I/O
        # utilisation has a denominator on an unshaped cluster)
        found = gauges(unshaped)
        nic = nic_bytes_per_s()
        source = "nic" if nic else "default"
        assert found["cacheflow_storage_link_capacity_bytes_per_second"] == (nic or DEFAULT_LINK_GBPS * 1e9 / 8) > 0
        assert found[f'cacheflow_storage_link_capacity_source_info{{source="{source}"}}'] == 1
    finally:
        shaped.stop()
        given.stop()
        unshaped.stop()


def _interface(sys_net: Path, name: str, speed: str | None, state: str = "up") -> None:
    (sys_net / name).mkdir(parents=True)
    (sys_net / name / "operstate").write_text(f"{state}\n")
    if speed is not None:
        (sys_net / name / "speed").write_text(f"{speed}\n")


def test_the_nic_speed_is_the_fastest_interface_up_that_reports_one(tmp_path):
    sys_net = tmp_path / "net"
    sys_net.mkdir()
    assert nic_bytes_per_s(sys_net) == 0  # no interface
    _interface(sys_net, "lo", "100000", state="unknown")  # loopback: not a link
    _interface(sys_net, "veth0", "-1")  # a virtual interface that does not know
    _interface(sys_net, "ifb0", None, state="down")  # a driver that refuses to say (EINVAL)
    assert nic_bytes_per_s(sys_net) == 0
    unshaped = StorageConfig(backend="memory", tokens={"t" * 16: "alpha"})
    assert link_capacity(unshaped, sys_net) == (DEFAULT_LINK_GBPS * 1e9 / 8, "default")
    _interface(sys_net, "eth0", "25000")
    _interface(sys_net, "eth1", "100000", state="down")
    assert nic_bytes_per_s(sys_net) == 25e9 / 8
    assert link_capacity(unshaped, sys_net) == (25e9 / 8, "nic")
