"""The metric names a PromQL expression reads: identifiers that are neither functions, keywords, label
names (in matchers, `by`/`without`/`on`/`ignoring`/`group_*` lists) nor numbers, strings or durations."""

from __future__ import annotations

import re

KEYWORDS = {"and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "atan2", "inf", "nan", "Inf", "NaN"}
STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+")  # Grafana's $__rate_interval, ${datasource}, ...
IDENTIFIER = re.compile(r"(?<![\w.])[A-Za-z_:][\w:]*")  # not the exponent of 1e3 nor a field after a dot
LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][\w:]*)\s*[,{]")


def metric_names(expr: str) -> set[str]:
    text = VARIABLES.sub("", STRINGS.sub('""', expr))
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range and subquery durations
    text = LABEL_LISTS.sub("", text)
    names = set()
    for match in IDENTIFIER.finditer(text):
        called = text[match.end():].lstrip().startswith("(")
        if not called and match.group(0) not in KEYWORDS:
            names.add(match.group(0))
    return names


def variable_metric(query: str) -> set[str]:
    """The metric a Grafana `label_values(metric{...}, label)` variable reads (none for `label_values(label)`)."""
    return set(LABEL_VALUES.findall(query))
