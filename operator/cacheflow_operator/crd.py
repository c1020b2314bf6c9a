"""The CacheFlowCluster CustomResourceDefinition, generated from the dataclasses in `spec.py`.

`python -m cacheflow_operator.crd` prints it as YAML; the Helm chart ships that output as
`charts/cacheflow/crds/cacheflowclusters.yaml` (a test checks the two are the same).
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Any

import yaml

from cacheflow_operator.spec import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    CacheFlowClusterSpec,
    camel,
    field_types,
)

INT_OR_STRING = {"anyOf": [{"type": "integer"}, {"type": "string"}], "x-kubernetes-int-or-string": True}
RESOURCES = {"type": "object", "properties": {
    "requests": {"type": "object", "additionalProperties": INT_OR_STRING},
    "limits": {"type": "object", "additionalProperties": INT_OR_STRING}}}
TOLERATION = {"type": "object", "properties": {
    "key": {"type": "string"}, "operator": {"type": "string", "enum": ["Exists", "Equal"]},
    "value": {"type": "string"}, "effect": {"type": "string", "enum": ["NoSchedule", "PreferNoSchedule", "NoExecute"]},
    "tolerationSeconds": {"type": "integer"}}}
SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean"}
CONDITION_TYPES = ["Ready", "Progressing", "Degraded"]


def _field_schema(hint: Any, f: dataclasses.Field[Any]) -> dict[str, Any]:
    constraints = dict(f.metadata.get("openapi", {}))
    kind = constraints.pop("kind", "")
    schema: dict[str, Any]
    if kind == "resources":
        schema = dict(RESOURCES)
    elif kind == "tolerations":
        schema = {"type": "array", "items": TOLERATION}
    elif dataclasses.is_dataclass(hint):
        schema = {**object_schema(hint), "default": {}}  # {} so the API server fills the nested defaults
    elif typing.get_origin(hint) is tuple:
        schema = {"type": "array", "items": {"type": SCALARS[typing.get_args(hint)[0]]}}
    elif typing.get_origin(hint) is dict:
        schema = {"type": "object", "additionalProperties": {"type": SCALARS[typing.get_args(hint)[1]]}}
        if f.default_factory is not dataclasses.MISSING and (default := f.default_factory()):
            schema["default"] = default
    else:
        schema = {"type": SCALARS[hint]}
        if f.default is not dataclasses.MISSING:
            schema["default"] = f.default
    return {"description": f.metadata["doc"], **schema, **constraints}


def object_schema(cls: Any) -> dict[str, Any]:
    """The OpenAPI v3 schema of a spec dataclass: camelCase properties with defaults and constraints."""
    hints = field_types(cls)
    props = {camel(f.name): _field_schema(hints[f.name], f) for f in dataclasses.fields(cls)}
    return {"type": "object", "properties": props}


def status_schema() -> dict[str, Any]:
    condition = {"type": "object", "required": ["type", "status"], "properties": {
        "type": {"type": "string", "enum": CONDITION_TYPES},
        "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
        "reason": {"type": "string"}, "message": {"type": "string"},
        "lastTransitionTime": {"type": "string", "format": "date-time"},
        "observedGeneration": {"type": "integer"}}}
    return {"type": "object", "properties": {
        "observedGeneration": {"type": "integer", "description": "the generation the operator last reconciled"},
        "conditions": {"type": "array", "items": condition, "x-kubernetes-list-type": "map",
                       "x-kubernetes-list-map-keys": ["type"]},
        "layerSplit": {"type": "string", "description": "the stages' layer ranges in use"},
        "endpoint": {"type": "string", "description": "the OpenAI-compatible API inside the cluster"}}}


def crd() -> dict[str, Any]:
    columns = [
        {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
        {"name": "Stages", "type": "integer", "jsonPath": ".spec.stages.count"},
        {"name": "Storage", "type": "integer", "jsonPath": ".spec.storage.pods"},
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.source"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
    schema = {"type": "object", "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"},
        "spec": {**object_schema(CacheFlowClusterSpec), "description": "the desired CacheFlow deployment"},
        "status": status_schema()}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}",
                     "labels": {"app.kubernetes.io/name": "cacheflow", "app.kubernetes.io/part-of": "cacheflow"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": list(SHORT_NAMES), "categories": ["cacheflow"]},
            "versions": [{"name": VERSION, "served": True, "storage": True,
                          "subresources": {"status": {}}, "additionalPrinterColumns": columns,
                          "schema": {"openAPIV3Schema": schema}}],
        },
    }


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # shared sub-schemas are written out in full
        return True


def render() -> str:
    header = (f"# The {KIND} CRD ({API_VERSION}). Generated by `python -m cacheflow_operator.crd`\n"
              "# from operator/spec.py: edit that, then regenerate this file.\n")
    return header + yaml.dump(crd(), Dumper=_NoAliases, sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render())
