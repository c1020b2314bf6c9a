"""Restores through real storage pods: placement, replication, a pod lost mid-run, and NIXL."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from cacheflow_common.engine import restore
from cacheflow_common.kv.keys import object_name
from cacheflow_common.store.placement import ClusterStore
from tests.common.test_restore import CHUNK, COSTS, _case
from tests.factories import tiny_model
from tests.services.chunks import make_chunks
from tests.services.procs import Pod, start_pod

N = 4 * CHUNK + 5


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3", seed=0, num_layers=4)


def _pods(tmp_path, n: int) -> list[Pod]:
    pods = []
    for i in range(n):
        (tmp_path / f"p{i}").mkdir()
        pods.append(start_pod(tmp_path / f"p{i}"))
    return pods


def _cluster(pods, replicas: int) -> ClusterStore:
    # Short client timeouts: a dead pod becomes a miss quickly and is skipped afterwards.
    return ClusterStore({f"pod-{i}": p.client(timeout_s=2.0, pod_id=f"pod-{i}") for i, p in enumerate(pods)},
                        replicas=replicas)


@pytest.mark.parametrize("replicas", [1, 2])
def test_restore_through_pods_survives_a_lost_pod(model, tmp_path, replicas):
    pods = _pods(tmp_path, 3)
    try:
        store = _cluster(pods, replicas)
        case = _case(model, N, seed=3, store=store)
        held = {pid: sum(pid in store.placement(store_name) for store_name in _names(case)) for pid in store.pods}
        assert all(held.values()), f"rendezvous left a pod empty: {held}"
        result = restore(case.job, model=model, store=store, policy="load-only", kv=case.kv)
        case.check(model, result)
        assert set(result.sources()) == {"loaded"}

        pods[0].kill()
        case.kv.data.zero_()
        result = restore(case.job, model=model, store=store, policy="cacheflow-token", costs=COSTS, l_delta=0,
                         kv=case.kv)
        case.check(model, result)  # whatever was lost was recomputed, and the KV is still right
        if replicas == 2:
            assert not result.misses  # every chunk had a copy on a live pod
    finally:
        for p in pods:
            p.stop()


def _names(case) -> list[str]:
    return [object_name(k, "kv", case.job.layers.start, case.job.layers.stop) for k in case.job.keys]


def test_read_many_spreads_over_pods(tmp_path):
    pods = _pods(tmp_path, 2)
    try:
        store = _cluster(pods, 1)
        chunks = make_chunks(8, seed=21)
        for name, obj in chunks:
            store.put(name, obj)
        bufs = [memoryview(bytearray(len(obj))) for _, obj in chunks]
        assert store.read_many([(name, buf, 0) for (name, _), buf in zip(chunks, bufs, strict=True)]) == [True] * 8
        assert [bytes(b) for b in bufs] == [obj for _, obj in chunks]
    finally:
        for p in pods:
            p.stop()


def test_nixl_data_plane_round_trip(tmp_path):
    nixl_plane = pytest.importorskip("cacheflow_common.transport.nixl_plane")
    pod = start_pod(tmp_path, transport="nixl")
    try:
        assert pod.transport == "nixl"
        endpoint = nixl_plane.NixlClientEndpoint(slots=2, slot_bytes=64 * 1024)  # small slots: reads are split
        client = pod.client(nixl=endpoint)
        chunks = make_chunks(3, tokens=96, seed=22)  # ~100 KB each: two pieces per whole read
        for name, obj in chunks:
            client.put(name, obj)
        for name, obj in chunks:
            buf = bytearray(len(obj))
            assert client.read_into(name, memoryview(buf))
            assert bytes(buf) == obj
        assert not client.read_into(chunks[0][0] + "x", memoryview(bytearray(8)))
        name, obj = chunks[1]
        parts = [bytearray(n) for n in (100, 64 * 1024, 0, 20_000)]  # across a slot's end
        assert client.readv_into(name, [memoryview(p) for p in parts], 7)
        assert b"".join(parts) == obj[7 : 7 + sum(len(p) for p in parts)]
    finally:
        pod.stop()


def test_nixl_readers_in_many_threads_at_once(tmp_path):
    """Several readers share a process's endpoint and a pod's agent, each driving UCX while it waits (no
    progress thread): every read lands whole. Without the agents' own synchronization they all missed."""
    nixl_plane = pytest.importorskip("cacheflow_common.transport.nixl_plane")
    pod = start_pod(tmp_path, transport="nixl")
    try:
        endpoint = nixl_plane.NixlClientEndpoint(slots=4, slot_bytes=256 * 1024)
        clients = [pod.client(nixl=endpoint) for _ in range(4)]
        chunks = make_chunks(4, tokens=96, seed=23)
        for name, obj in chunks:
            clients[0].put(name, obj)

        def reads(i: int) -> bool:
            name, obj = chunks[i]
            buf = bytearray(len(obj))
            return all(clients[i].read_into(name, memoryview(buf)) and bytes(buf) == obj for _ in range(25))

        with ThreadPoolExecutor(max_workers=4) as readers:
            assert list(readers.map(reads, range(4))) == [True] * 4
    finally:
        pod.stop()
