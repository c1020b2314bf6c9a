"""Human-friendly sizes for command lines and specs ("64MiB", "10GB", "4096")."""

from __future__ import annotations

import re

from cacheflow_common.errors import ConfigError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """"64MiB" -> 67108864; ConfigError for anything that is not a non-negative size."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(f"bad size {text!r}: use e.g. 4096, 64MiB or 10GB")
    return int(float(match.group(1)) * _UNITS[unit])
