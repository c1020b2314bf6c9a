"""Applying the desired children: create what is missing, patch only what differs, delete what is no longer wanted.

A child is patched with a JSON merge patch computed three ways, as `kubectl apply` does: fields the
desired object sets and the live one lacks or holds differently are set; fields the last applied
object (kept in an annotation) set and the desired one no longer does are removed. Fields the API
server added (defaults, status) are left alone, so reconciling an unchanged resource sends nothing.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from cacheflow_operator.kube import Kube, Ref
from cacheflow_operator.manifests.build import children
from cacheflow_operator.manifests.common import MANAGER, quantity
from cacheflow_operator.spec import Cluster

log = logging.getLogger(__name__)

LAST_APPLIED = "cacheflow.io/last-applied"
CHILD_KINDS = (("v1", "ConfigMap"), ("v1", "Service"), ("apps/v1", "StatefulSet"), ("apps/v1", "Deployment"))
# A StatefulSet's spec accepts changes only to these fields; the others take effect when it is recreated.
STATEFULSET_MUTABLE = {"replicas", "template", "updateStrategy", "persistentVolumeClaimRetentionPolicy",
                       "minReadySeconds", "ordinals"}


def same_scalar(want: Any, have: Any) -> bool:
    """Equal, or the same Kubernetes quantity written differently (the API server canonicalises "0.5" to "500m")."""
    if isinstance(want, bool) or isinstance(have, bool):  # True == 1 in Python, not in Kubernetes
        return type(want) is type(have) and want == have
    if want == have:
        return True
    if not isinstance(want, str | int | float):
        return False
    try:
        return quantity(want) == quantity(have)
    except ValueError:
        return False


def contains(have: Any, want: Any) -> bool:
    """Whether `have` holds everything `want` sets (dicts: per key; lists: same length, item by item)."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(k in have and contains(have[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and len(have) == len(want) and all(map(contains, have, want))
    return same_scalar(want, have)


def merge_patch(last: Any, want: dict[str, Any], have: dict[str, Any]) -> dict[str, Any]:
    """The merge patch that makes `have` contain `want` and drops what `last` set but `want` no longer does."""
    last = last if isinstance(last, dict) else {}
    patch: dict[str, Any] = {}
    for key, value in want.items():
        if key not in have:
            patch[key] = value
        elif isinstance(value, dict) and isinstance(have[key], dict):
            if sub := merge_patch(last.get(key), value, have[key]):
                patch[key] = sub
        elif not contains(have[key], value):
            patch[key] = value
    patch.update({key: None for key in last if key not in want and key in have})
    return patch


def with_last_applied(obj: dict[str, Any]) -> dict[str, Any]:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    meta = obj["metadata"]
    return {**obj, "metadata": {**meta, "annotations": {**meta.get("annotations", {}), LAST_APPLIED: text}}}


def child_patch(want: dict[str, Any], have: dict[str, Any]) -> dict[str, Any]:
    """The patch for one child (empty: nothing to do); a StatefulSet's immutable fields are left out."""
    annotations = have.get("metadata", {}).get("annotations") or {}
    last = json.loads(annotations[LAST_APPLIED]) if LAST_APPLIED in annotations else None
    patch = merge_patch(last, with_last_applied(want), have)
    if want["kind"] == "StatefulSet" and "spec" in patch:
        if frozen := sorted(set(patch["spec"]) - STATEFULSET_MUTABLE):
            log.warning("%s: %s cannot change in place (delete the StatefulSet to apply them)", Ref.of(want), frozen)
        patch["spec"] = {k: v for k, v in patch["spec"].items() if k in STATEFULSET_MUTABLE}
        if not patch["spec"]:
            del patch["spec"]
    return patch


def apply(kube: Kube, want: dict[str, Any]) -> str:
    """Create or patch one child; returns what it did ("" for nothing)."""
    ref = Ref.of(want)
    have = kube.get(ref)
    if have is None:
        kube.create(with_last_applied(want))
        return f"created {ref}"
    if patch := child_patch(want, have):
        kube.patch(ref, patch)
        return f"patched {ref}"
    return ""


def owned_by(obj: dict[str, Any], c: Cluster) -> bool:
    return any(o.get("uid") == c.uid and o.get("controller") for o in obj["metadata"].get("ownerReferences") or [])


def stale_children(kube: Kube, c: Cluster, wanted: list[dict[str, Any]]) -> list[Ref]:
    """Children this resource controls that are no longer wanted (a removed stage, say)."""
    keep = {Ref.of(obj) for obj in wanted}
    selector = {"cacheflow.io/cluster": c.name, "app.kubernetes.io/managed-by": MANAGER}
    found = [Ref.of({**obj, "apiVersion": v, "kind": k}) for v, k in CHILD_KINDS
             for obj in kube.list(Ref(v, k, c.namespace), selector) if owned_by(obj, c)]
    return [ref for ref in found if ref not in keep]


def reconcile(kube: Kube, c: Cluster) -> list[str]:
    """Bring every child in line with the resource; returns the changes made (none when already in line)."""
    wanted = children(c)
    actions = [done for obj in wanted if (done := apply(kube, obj))]
    for ref in stale_children(kube, c, wanted):
        kube.delete(ref)
        actions.append(f"deleted {ref}")
    return actions
