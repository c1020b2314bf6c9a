"""The chart's values.schema.json: its `cluster.spec` part is the CRD's spec schema (less `image`, `auth` and
`networkPolicy`, which the chart fills from its own values), made strict so that a misspelt value fails `helm install`.

`python -m cacheflow_operator.chart_schema charts/cacheflow/values.schema.json` rewrites that part in
place after a change to operator/spec.py (a test checks the file is in sync).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

from cacheflow_operator.crd import object_schema
from cacheflow_operator.spec import CacheFlowClusterSpec

CHART_FILLED = ("image", "auth", "networkPolicy")  # spec sections the chart's templates set from its own values


def strict(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy where every object with declared properties refuses unknown ones."""
    out = copy.deepcopy(schema)
    if "properties" in out:
        out["additionalProperties"] = False
        out["properties"] = {k: strict(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = strict(out["items"])
    return out


def cluster_spec_schema() -> dict[str, Any]:
    schema = object_schema(CacheFlowClusterSpec)
    schema["properties"] = {k: v for k, v in schema["properties"].items() if k not in CHART_FILLED}
    return {"description": "the CacheFlowCluster's spec (image, auth and networkPolicy come from the chart's values)",
            **strict(schema)}


def sync(path: Path) -> None:
    values_schema = json.loads(path.read_text())
    values_schema["properties"]["cluster"]["properties"]["spec"] = cluster_spec_schema()
    path.write_text(json.dumps(values_schema, indent=2) + "\n")


if __name__ == "__main__":
    sync(Path(sys.argv[1]))
