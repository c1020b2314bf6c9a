"""A storage pod serves an object's replacement, whatever the old copy's reads were doing meanwhile, and a
truncated object is absent to every lookup (and dropped): a pod in this process, its backend paused at
the moment that matters."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from cacheflow_common.kv.chunk import SECTION_HEADER_SIZE
from cacheflow_common.transport.wire import Status
from cacheflow_services.storage.config import StorageConfig
from cacheflow_services.storage.pod import StoragePod
from cacheflow_services.storage.reads import ReadPlan
from tests.services.chunks import make_chunks

TENANT = "alpha"


@pytest.fixture
def pod() -> StoragePod:
    return StoragePod(StorageConfig(backend="memory", tokens={"a-long-enough-secret-token-1": TENANT}))


def _read(pod: StoragePod, name: str, length: int) -> tuple[Status, str]:
    """Bytes [0, length) of the object read as a client's GET is, piece by piece."""
    plan = pod.plan_read(TENANT, name, 0, length)
    if not isinstance(plan, ReadPlan):
        return plan
    buf = memoryview(bytearray(plan.buffer_bytes()))
    for start, n in plan.pieces():
        status, reason = pod.read_piece(plan, start, buf[:n])
        if status is not Status.OK:
            return status, reason
    return Status.OK, ""


def _pause(pod: StoragePod, method: str, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """The pod backend's next call of `method` waits for the second event, once it has set the first."""
    entered, release = threading.Event(), threading.Event()
    real: Callable[..., object] = getattr(pod.backend, method)

    def paused(*args: object) -> object:
        if not entered.is_set():
            entered.set()
            release.wait(60)
        return real(*args)

    monkeypatch.setattr(pod.backend, method, paused)
    return entered, release


def _while_paused(entered: threading.Event, release: threading.Event, first: Callable[[], object],
                  then: Callable[[], object]) -> None:
    """`first` in a thread until it pauses, `then` in another (left to finish, if it can, before the pause
    ends), then both to their end."""
    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert entered.wait(60)
    threads.append(threading.Thread(target=then))
    threads[1].start()
    threads[1].join(timeout=2)
    release.set()
    for thread in threads:
        thread.join(60)


def test_a_chunk_rewritten_while_a_reader_drops_its_corrupt_copy_stays(pod, monkeypatch):
    (name, good), = make_chunks(1)
    bad = bytearray(good)
    bad[SECTION_HEADER_SIZE + 5] ^= 0xFF  # a payload byte of section 0: its crc fails
    pod.backend.put(pod.stored_name(TENANT, name), bytes(bad))
    entered, release = _pause(pod, "delete", monkeypatch)  # the reader, dropping the corrupt copy
    _while_paused(entered, release, lambda: _read(pod, name, len(good)),
                  lambda: pod.write(TENANT, name, memoryview(good)))
    assert pod.size(TENANT, name) == len(good)
    assert _read(pod, name, len(good)) == (Status.OK, "")


def test_a_layout_read_from_the_old_copy_is_not_kept_for_its_replacement(pod, monkeypatch):
    (name, old), = make_chunks(1, tokens=16)
    new = make_chunks(1, tokens=32)[0][1]  # another layout (longer) under the same name
    pod.backend.put(pod.stored_name(TENANT, name), old)
    entered, release = _pause(pod, "read_into", monkeypatch)  # the reader, reading the old copy's layout
    _while_paused(entered, release, lambda: pod.size(TENANT, name),
                  lambda: pod.write(TENANT, name, memoryview(new)))
    assert _read(pod, name, len(new)) == (Status.OK, "")
    assert pod.size(TENANT, name) == len(new)


def test_a_layout_remembered_from_a_copy_replaced_behind_the_pods_back_does_not_drop_the_new_one(pod):
    (name, old), = make_chunks(1, tokens=16)
    new = make_chunks(1, tokens=32)[0][1]  # another layout (longer) under the same name
    stored = pod.stored_name(TENANT, name)
    pod.write(TENANT, name, memoryview(old))
    assert _read(pod, name, len(old)) == (Status.OK, "")  # its layout remembered
    pod.backend.put(stored, new)  # as another pod sharing this Redis would write it
    assert _read(pod, name, len(old)) == (Status.MISS, "replaced while it was read")  # not CORRUPT
    assert pod.backend.read(stored) == new  # kept
    assert _read(pod, name, len(new)) == (Status.OK, "")


@pytest.mark.parametrize("keep", [0.5, 0.99, 10])
def test_a_truncated_object_is_absent_and_dropped_and_its_replacement_served(pod, keep):
    (name, good), = make_chunks(1)
    stored = pod.stored_name(TENANT, name)
    pod.backend.put(stored, good[: int(len(good) * keep) if keep < 1 else keep])
    assert pod.size(TENANT, name) is None and pod.exists(TENANT, [name]) == [False]
    assert not pod.backend.exists(stored)  # dropped, as a corrupt copy is
    assert _read(pod, name, 64)[0] is Status.MISS
    pod.write(TENANT, name, memoryview(good))
    assert pod.size(TENANT, name) == len(good) and pod.exists(TENANT, [name]) == [True]
    assert _read(pod, name, len(good)) == (Status.OK, "")
