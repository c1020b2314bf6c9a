"""Rendezvous placement: balanced, stable when pods come and go, replicated, and routed around failures."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from cacheflow_common.errors import ConfigError, StoreError
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.placement import ClusterStore


class FlakyPod(MemoryStore):
    """An in-process pod whose reachability the test controls (the real pods are in tests/services)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    def failed_within(self, seconds: float) -> bool:
        return self.down

    def put(self, name: str, data: bytes | memoryview) -> None:
        if self.down:
            raise StoreError("pod down")
        super().put(name, data)

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        return not self.down and super().readv_into(name, views, offset)


NAMES = [f"{i:032x}.kv.L0-4" for i in range(3000)]


def _cluster(n: int, replicas: int = 1) -> ClusterStore:
    return ClusterStore({f"pod-{i}": FlakyPod() for i in range(n)}, replicas=replicas)


def test_placement_is_balanced_and_deterministic():
    store = _cluster(4)
    counts = {p: 0 for p in store.pods}
    for name in NAMES:
        counts[store.placement(name)[0]] += 1
    assert all(abs(c - len(NAMES) / 4) < 0.1 * len(NAMES) / 4 for c in counts.values()), counts
    assert [store.placement(n) for n in NAMES[:50]] == [_cluster(4).placement(n) for n in NAMES[:50]]


def test_adding_a_pod_moves_only_its_share():
    before, after = _cluster(4), _cluster(5)
    moved = [n for n in NAMES if before.placement(n)[0] != after.placement(n)[0]]
    assert all(after.placement(n)[0] == "pod-4" for n in moved)  # only to the new pod
    assert abs(len(moved) - len(NAMES) / 5) < 0.15 * len(NAMES) / 5


def test_replicas_keep_data_readable_when_a_pod_is_down():
    store = _cluster(3, replicas=2)
    for name in NAMES[:100]:
        store.put(name, name.encode())
    store.pods["pod-1"].down = True  # type: ignore[attr-defined]
    assert all(store.read(n) == n.encode() for n in NAMES[:100])
    buf = memoryview(bytearray(4))
    assert all(store.read_into(n, buf, 2) for n in NAMES[:100])


def test_without_replicas_a_down_pod_means_misses_and_writes_go_elsewhere():
    store = _cluster(3)
    for name in NAMES[:300]:
        store.put(name, name.encode())
    store.pods["pod-0"].down = True  # type: ignore[attr-defined]
    lost = [n for n in NAMES[:300] if store.read(n) is None]
    assert 50 < len(lost) < 150  # about a third
    store.put(lost[0], b"again")  # the next live pod in rank order takes it
    assert store.read(lost[0]) == b"again"


def test_all_pods_down_is_a_store_error_on_write():
    store = _cluster(2)
    for pod in store.pods.values():
        pod.down = True  # type: ignore[attr-defined]
    with pytest.raises(StoreError, match="no pod stored"):
        store.put(NAMES[0], b"x")


def test_bad_cluster_config():
    with pytest.raises(ConfigError):
        ClusterStore({}, replicas=1)
    with pytest.raises(ConfigError):
        _cluster(2, replicas=3)
