"""Fixtures the reliability tests share: one quick profile of the tiny model for the session, `cacheflow
up` processes stopped (with every child) after each test, and a small local cluster per module with a
client of its coordinator (a module that needs other settings defines its own `local`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from cacheflow_services.local_cluster import LocalCluster
from tests.reliability.coordinator_checks import api_client, small_cluster
from tests.reliability.up_cluster import Up, stopped_after, tiny_profile


@pytest.fixture(scope="session")
def quick_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_profile(tmp_path_factory.mktemp("profile"))


@pytest.fixture
def ups() -> Iterator[Callable[[Up], Up]]:
    with stopped_after() as register:
        yield register


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from small_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def client(local: LocalCluster) -> Iterator[httpx.Client]:
    yield from api_client(local)
