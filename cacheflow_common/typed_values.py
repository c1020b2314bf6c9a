"""Values read from YAML or JSON (a local cluster spec, a CacheFlowCluster resource) checked against the
type hint of the dataclass field they fill: a wrong one is a ConfigError in one line that names the field,
the value and what was expected (`stages: two` -> "stages must be an integer, not 'two'")."""

from __future__ import annotations

import typing
from typing import Any

from cacheflow_common.errors import ConfigError

EXPECTED: dict[Any, str] = {str: "a string", bool: "true or false", int: "an integer", float: "a number",
                            dict: "a mapping"}
EXPECTED_ITEMS: dict[Any, str] = {str: "strings", bool: "booleans", int: "integers", float: "numbers",
                                  dict: "mappings"}
ACCEPTED: dict[Any, type | tuple[type, ...]] = {str: str, bool: bool, int: int, float: (int, float), dict: dict,
                                                list: list, tuple: list}


def typed_value(hint: Any, value: Any, name: str) -> Any:
    """`value` as a field typed `hint` holds it (a YAML list as a tuple where a tuple is expected, an integer
    as a float where a number is); ConfigError naming `name`, the value and what was expected otherwise.
    The items of a list or tuple are checked too; a mapping's keys and values are not."""
    origin = typing.get_origin(hint) or hint
    if origin not in ACCEPTED:
        raise TypeError(f"{name}: no check for values of type {hint}")  # a field type this module does not know
    if not _accepts(origin, value):
        raise ConfigError(f"{name} must be {_expected(hint)}, not {value!r}")
    if origin in (list, tuple):
        item = typing.get_args(hint)[0]
        value = [typed_value(item, v, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(value) if origin is tuple else value
    return float(value) if origin is float else value


def _accepts(origin: Any, value: Any) -> bool:
    """YAML's true and false are not numbers here, though Python's bool is an int."""
    return isinstance(value, ACCEPTED[origin]) and (origin is bool or not isinstance(value, bool))


def _expected(hint: Any) -> str:
    origin = typing.get_origin(hint) or hint
    if origin in (list, tuple):
        item = typing.get_args(hint)[0]
        return f"a list of {EXPECTED_ITEMS[typing.get_origin(item) or item]}"
    return EXPECTED[origin]
