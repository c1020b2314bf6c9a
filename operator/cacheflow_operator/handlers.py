"""The kopf handlers: thin glue between kopf's events and the pure builders, `apply` and `status`.

* create / update (of the spec) / resume (operator restart): reconcile the children, then the status.
* an event on a Deployment, StatefulSet or NetworkPolicy the operator manages: recompute its owner's
  status from the workloads' readiness (patched only when it changed; the events that queued behind one
  such refresh share the next, `coalesce`); a deleted child is recreated (a deleted NetworkPolicy would
  leave its pods open to more than they need).
* status writes and reconciles of one resource never overlap (`exclusive`), so the last status written
  is computed from the latest view.
* deletion needs no handler: every child carries an ownerReference to the resource (controller: true),
  so Kubernetes' garbage collector deletes them with it, and no finalizer holds the deletion up.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import kopf

from cacheflow_common.errors import ConfigError
from cacheflow_operator import status as st
from cacheflow_operator.apply import reconcile
from cacheflow_operator.coalesce import Coalescer
from cacheflow_operator.kube import Kube, KubeError, Ref
from cacheflow_operator.manifests.common import MANAGER, coordinator_url
from cacheflow_operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, Cluster
from cacheflow_operator.tls_secret import ensure_tls_secret

MANAGED = {"app.kubernetes.io/managed-by": MANAGER}
RETRY_S = 30  # after the API refused a child
RENEW_CHECK_S = 6 * 3600  # how often the TLS certificate's expiry is looked at
log = logging.getLogger(__name__)


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.peering.standalone = True  # one operator replica: no peering resources, no RBAC for them
    settings.scanning.disabled = True  # no cluster-wide watch of namespaces and CRDs: the resources are known
    # kopf's own bookkeeping in annotations: the status keeps to the CRD's schema
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.INFO
    memo.kube = Kube.from_environment()
    memo.stop_renewing = threading.Event()
    threading.Thread(target=renew_certificates, args=(memo.kube, memo.stop_renewing), name="renew-certificates",
                     daemon=True).start()


@kopf.on.cleanup()
def stop_renewing(memo: kopf.Memo, **_: Any) -> None:
    memo.stop_renewing.set()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account in a cluster, else the kubeconfig."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def observe(kube: Kube, c: Cluster, resource: dict[str, Any]) -> dict[str, Any]:
    """The status the resource should show now, from its workloads as they are (after a successful reconcile)."""
    workloads = [st.Workload.of(label, kube.get(Ref("apps/v1", kind, c.namespace, name)))
                 for kind, name, label in st.workload_refs(c)]
    previous = [cond for cond in conditions_of(resource) if cond.get("reason") not in st.SPEC_FAILURES]
    generation = int(resource["metadata"].get("generation") or 0)
    return {"conditions": st.conditions(workloads, previous, generation, st.now_rfc3339()),
            "layerSplit": ",".join(f"{r.start}:{r.stop}" for r in c.spec.split()), "endpoint": coordinator_url(c)}


def conditions_of(resource: dict[str, Any]) -> list[dict[str, Any]]:
    return list((resource.get("status") or {}).get("conditions") or [])


_locks: defaultdict[tuple[str, str], threading.RLock] = defaultdict(threading.RLock)
_locks_guard = threading.Lock()


@contextlib.contextmanager
def exclusive(ref: Ref) -> Iterator[None]:
    """One reconcile or status write per resource at a time: kopf runs the handlers of the resource and of
    its workloads' events in parallel threads, and a status computed from an older view must not land last."""
    with _locks_guard:
        lock = _locks[ref.namespace, ref.name]
    with lock:
        yield


def write_status(kube: Kube, ref: Ref, compute: Callable[[dict[str, Any]], dict[str, Any] | None]) -> None:
    """Read the resource, compute its status from it (None: leave it), patch what changed."""
    with exclusive(ref):
        resource = kube.get(ref)
        if resource is None or resource["metadata"].get("deletionTimestamp"):
            return
        new = compute(resource)
        current = resource.get("status") or {}
        if new and (changed := {k: v for k, v in new.items() if current.get(k) != v}):
            kube.patch(ref, {"status": changed}, subresource="status")


def failure(reason: str, exc: Exception, generation: int) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda resource: {"observedGeneration": generation, "conditions": st.failed_conditions(
        reason, str(exc), conditions_of(resource), generation, st.now_rfc3339())}


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile_cluster(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    kube: Kube = memo.kube
    ref = Ref(API_VERSION, KIND, body.metadata.namespace or "default", body.metadata.name or "")
    generation = int(body.meta.get("generation") or 0)
    try:
        cluster = Cluster.from_resource(dict(body))
    except ConfigError as exc:
        write_status(kube, ref, failure("InvalidSpec", exc, generation))
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc
    _reconciled.add(ref)
    with exclusive(ref):
        try:
            actions = reconcile(kube, cluster)
        except KubeError as exc:  # refused (admission, quota, RBAC): say so, and try again later
            write_status(kube, ref, failure("ApplyFailed", exc, generation))
            raise kopf.TemporaryError(str(exc), delay=RETRY_S) from exc
        for action in actions:
            logger.info(action)
        write_status(kube, ref, lambda resource: {**observe(kube, cluster, resource),
                                                  "observedGeneration": generation})


_refreshes = Coalescer()  # the status refreshes after child events, per (resource, its uid)
_reconciled: set[Ref] = set()  # the resources this operator has reconciled: their certificates are renewed


def renew_certificates(kube: Kube, stop: threading.Event) -> None:
    """Every `RENEW_CHECK_S`, renew the TLS certificate of each resource reconciled so far that needs it,
    even while nothing else changes. A thread of the operator's own, not a kopf timer: kopf puts a
    finalizer on every resource with a timer, and nothing here should hold a deletion up."""
    while not stop.wait(RENEW_CHECK_S):
        for ref in list(_reconciled):
            try:
                resource = kube.get(ref)
                if resource is None:
                    _reconciled.discard(ref)
                    continue
                with exclusive(ref):
                    if done := ensure_tls_secret(kube, Cluster.from_resource(resource)):
                        log.info("%s: %s", ref, done)
            except (ConfigError, KubeError) as exc:  # the spec handler reports a bad spec; the API may be away
                log.warning("%s: certificate not checked: %s", ref, exc)


def _owner(body: kopf.Body) -> Ref | None:
    owner = next((o for o in body.metadata.get("ownerReferences") or []
                  if o.get("controller") and o.get("apiVersion") == API_VERSION and o.get("kind") == KIND), None)
    if owner is None or body.metadata.namespace is None:
        return None
    return Ref(API_VERSION, KIND, body.metadata.namespace, owner["name"])


@kopf.on.event("apps", "v1", "deployments", labels=MANAGED)
@kopf.on.event("apps", "v1", "statefulsets", labels=MANAGED)
@kopf.on.event("networking.k8s.io", "v1", "networkpolicies", labels=MANAGED)
def child_event(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    kube: Kube = memo.kube
    if (ref := _owner(body)) is None:
        return
    owner_uid = next(o["uid"] for o in body.metadata["ownerReferences"] if o.get("controller"))

    def refresh(resource: dict[str, Any]) -> dict[str, Any] | None:
        if resource["metadata"].get("uid") != owner_uid or st.spec_failed(conditions_of(resource)):
            return None  # another resource of that name, or a failed reconcile whose condition must stand
        try:
            cluster = Cluster.from_resource(resource)
        except ConfigError:
            return None  # the spec handler reports it
        if event.get("type") == "DELETED":
            for action in reconcile(kube, cluster):
                logger.info(f"{action} (a child was deleted)")
        return observe(kube, cluster, resource)

    if event.get("type") == "DELETED":  # never skipped: the child is recreated
        write_status(kube, ref, refresh)
        return
    key = (ref, owner_uid)
    ticket = _refreshes.arrive(key)
    with exclusive(ref):
        if _refreshes.covered(key, ticket):
            return  # a refresh that read everything after this event has finished
        started_at = _refreshes.start(key)
        write_status(kube, ref, refresh)
        _refreshes.finish(key, started_at)
