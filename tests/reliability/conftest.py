"""Fixtures the `cacheflow up` reliability tests share: one quick profile of the tiny model for the
session, and `cacheflow up` processes stopped (with every child) after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.reliability.up_cluster import Up, stopped_after, tiny_profile


@pytest.fixture(scope="session")
def quick_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_profile(tmp_path_factory.mktemp("profile"))


@pytest.fixture
def ups() -> Iterator[Callable[[Up], Up]]:
    with stopped_after() as register:
        yield register
