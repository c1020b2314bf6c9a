"""Applying the desired children with Kubernetes server-side apply; deleting the ones no longer wanted.

Each child is sent whole as an apply patch (`PATCH`, `application/apply-patch+yaml`) under the field
manager `cacheflow-operator`, with `force`: the operator owns every field it sets on its children, and a
conflicting change by another manager (`kubectl edit`, say) is taken back. The API server does the merge:
it records in managedFields which fields this manager owns, removes the ones it owned and no longer sends,
leaves other managers' fields and its own defaults alone, and writes nothing (no new resourceVersion, no
watch event) when the object already holds what is sent. A missing child is created by the same request.

A StatefulSet accepts changes only to some spec fields: for the others the live values are sent back, so
an apply never fails on them (they take effect when the StatefulSet is deleted and recreated).

The internal Secret is not applied: it is created once when missing and never replaced (its token and
keys must not change under running pods). Nor is the TLS Secret: created once, its certificate renewed
before it expires, its CA kept (`tls_secret.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from cacheflow_common.auth import new_cluster_secrets
from cacheflow_operator.kube import Kube, KubeError, Ref
from cacheflow_operator.manifests.build import children
from cacheflow_operator.manifests.common import MANAGER, internal_secret_name, quantity
from cacheflow_operator.manifests.secret import KEYS, internal_secret
from cacheflow_operator.spec import Cluster
from cacheflow_operator.tls_secret import ensure_tls_secret

log = logging.getLogger(__name__)

FIELD_MANAGER = MANAGER  # "cacheflow-operator": the owner of the children's fields in managedFields
CHILD_KINDS = (("v1", "ConfigMap"), ("v1", "Service"), ("apps/v1", "StatefulSet"), ("apps/v1", "Deployment"),
               ("networking.k8s.io/v1", "NetworkPolicy"))
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


def keep_immutable(want: dict[str, Any], have: dict[str, Any] | None) -> dict[str, Any]:
    """`want` with a live StatefulSet's immutable spec fields as they are where `want` would change them."""
    if want["kind"] != "StatefulSet" or have is None:
        return want
    live = have.get("spec") or {}
    spec = dict(want["spec"])
    frozen = sorted(k for k, v in spec.items()
                    if k not in STATEFULSET_MUTABLE and k in live and not contains(live[k], v))
    if not frozen:
        return want
    log.warning("%s: %s cannot change in place (delete the StatefulSet to apply them)", Ref.of(want), frozen)
    spec.update({k: live[k] for k in frozen})
    return {**want, "spec": spec}


def apply(kube: Kube, want: dict[str, Any]) -> str:
    """Server-side apply one child; returns what happened ("" when the API server changed nothing)."""
    ref = Ref.of(want)
    have = kube.get(ref)
    applied = kube.apply(keep_immutable(want, have), field_manager=FIELD_MANAGER, force=True) or {}
    if have is None:
        return f"created {ref}"
    before, after = have["metadata"].get("resourceVersion"), applied.get("metadata", {}).get("resourceVersion")
    return f"updated {ref}" if before != after else ""


def ensure_internal_secret(kube: Kube, c: Cluster) -> str:
    """Create the cluster's internal Secret (internal token, grant key pair) if it does not exist; never replace it."""
    ref = Ref("v1", "Secret", c.namespace, internal_secret_name(c))
    have = kube.get(ref)
    if have is not None:
        if missing := sorted(set(KEYS) - set(have.get("data") or {})):
            log.warning("%s lacks %s: the pods that mount them cannot start (delete it to have it recreated)",
                        ref, missing)
        return ""
    try:
        kube.create(internal_secret(c, new_cluster_secrets()))
    except KubeError as exc:
        if exc.status == 409:  # created meanwhile: that one stands
            return ""
        raise
    return f"created {ref}"


def owned_by(obj: dict[str, Any], c: Cluster) -> bool:
    return any(o.get("uid") == c.uid and o.get("controller") for o in obj["metadata"].get("ownerReferences") or [])


def stale_children(kube: Kube, c: Cluster, wanted: list[dict[str, Any]]) -> list[Ref]:
    """Children this resource controls that are no longer wanted (a removed stage, NetworkPolicies turned off)."""
    keep = {Ref.of(obj) for obj in wanted}
    selector = {"cacheflow.io/cluster": c.name, "app.kubernetes.io/managed-by": MANAGER}
    found = [Ref.of({**obj, "apiVersion": v, "kind": k}) for v, k in CHILD_KINDS
             for obj in kube.list(Ref(v, k, c.namespace), selector) if owned_by(obj, c)]
    return [ref for ref in found if ref not in keep]


def reconcile(kube: Kube, c: Cluster) -> list[str]:
    """Bring every child in line with the resource; returns the changes made (none when already in line)."""
    wanted = children(c)
    secrets = (ensure_internal_secret(kube, c), ensure_tls_secret(kube, c))
    actions = [done for done in (*secrets, *(apply(kube, obj) for obj in wanted)) if done]
    for ref in stale_children(kube, c, wanted):
        kube.delete(ref)
        actions.append(f"deleted {ref}")
    return actions
