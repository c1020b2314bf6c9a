from __future__ import annotations

import pytest

from cacheflow_common.errors import ConfigError
from cacheflow_common.units import parse_bytes


@pytest.mark.parametrize(("text", "value"), [("4096", 4096), ("64MiB", 64 << 20), ("10GB", 10**10), ("1.5kib", 1536),
                                             ("0", 0)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "-1", "10 parsecs", "MiB", "1e9"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ConfigError):
        parse_bytes(text)
