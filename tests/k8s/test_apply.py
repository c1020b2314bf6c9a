"""The three-way merge patch the operator applies children with: nothing for an unchanged child (whatever
the API server added), the desired value where it differs, null for what a previous apply set and the
desired object no longer does."""

from __future__ import annotations

import copy
import json

from cacheflow_operator.apply import LAST_APPLIED, child_patch, contains, merge_patch, with_last_applied
from cacheflow_operator.manifests.build import children
from cacheflow_operator.spec import Cluster


def cluster(**spec):
    return Cluster.from_resource({"metadata": {"name": "demo", "namespace": "ml", "uid": "u1"}, "spec": spec})


def as_served(obj):
    """The child as the API server would return it: applied, then defaulted and given a status."""
    live = copy.deepcopy(with_last_applied(obj))
    live["metadata"].update(uid="x", resourceVersion="7", generation=1, creationTimestamp="2026-01-01T00:00:00Z")
    spec = live.get("spec", {})
    if "template" in spec:
        spec.setdefault("revisionHistoryLimit", 10)
        pod = spec["template"]["spec"]
        pod.update(dnsPolicy="ClusterFirst", restartPolicy="Always", schedulerName="default-scheduler")
        for c in pod["containers"]:
            c.update(terminationMessagePath="/dev/termination-log", terminationMessagePolicy="File")
            c["readinessProbe"]["successThreshold"] = 1
        live["status"] = {"replicas": 1, "readyReplicas": 1}
    if obj["kind"] == "Service":
        spec.update(clusterIPs=["10.0.0.7"], sessionAffinity="None", ipFamilies=["IPv4"])
    return live


def test_an_unchanged_child_needs_no_patch():
    for obj in children(cluster(stages={"count": 3, "resources": {"limits": {"cpu": "0.5"}}})):
        live = as_served(obj)
        if obj["kind"] == "Deployment":  # the API server writes quantities canonically
            for c in live["spec"]["template"]["spec"]["containers"]:
                if c["resources"].get("limits", {}).get("cpu") == "0.5":
                    c["resources"]["limits"]["cpu"] = "500m"
        assert child_patch(obj, live) == {}, obj["metadata"]["name"]


def test_a_changed_list_is_replaced_whole_and_the_annotation_follows():
    before = children(cluster(stages={"count": 2}))[4]  # Deployment demo-stage-0
    after = children(cluster(stages={"count": 2, "chunkSize": 512}))[4]
    patch = child_patch(after, as_served(before))
    (container,) = patch["spec"]["template"]["spec"]["containers"]
    assert "512" in container["args"] and container["name"] == "worker"  # the whole container list
    assert json.loads(patch["metadata"]["annotations"][LAST_APPLIED]) == after
    assert set(patch) == {"metadata", "spec"}


def test_what_the_last_apply_set_and_the_new_one_does_not_is_removed():
    before = children(cluster(stages={"nodeSelector": {"gpu": "h100"}}))[4]
    after = children(cluster())[4]
    patch = child_patch(after, as_served(before))
    assert patch["spec"]["template"]["spec"]["nodeSelector"] is None


def test_fields_others_set_are_left_alone():
    obj = children(cluster())[4]
    live = as_served(obj)
    live["metadata"]["annotations"]["team"] = "ml-infra"  # someone else's annotation
    live["spec"]["template"]["metadata"]["annotations"]["kubectl.kubernetes.io/restartedAt"] = "now"
    assert child_patch(obj, live) == {}


def test_a_statefulsets_immutable_fields_are_not_patched():
    before = next(o for o in children(cluster()) if o["kind"] == "StatefulSet")
    after = next(o for o in children(cluster(storage={"volumeSize": "100Gi", "pods": 3})) if o["kind"] == "StatefulSet")
    patch = child_patch(after, as_served(before))
    assert patch["spec"] == {"replicas": 3, "template": patch["spec"]["template"]}  # no volumeClaimTemplates


def test_merge_patch_and_contains_basics():
    assert merge_patch(None, {"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}) == {}
    assert merge_patch({"a": {"x": 1}}, {"a": {"b": 2}}, {"a": {"b": 1, "x": 1}}) == {"a": {"b": 2, "x": None}}
    assert merge_patch(None, {"l": [1, 2]}, {"l": [1]}) == {"l": [1, 2]}
    assert contains({"l": [{"a": 1, "b": 2}]}, {"l": [{"a": 1}]})
    assert not contains({"l": [{"a": 1}, {"a": 2}]}, {"l": [{"a": 1}]})
    assert contains({"q": "1Gi"}, {"q": "1024Mi"}) and not contains({"q": "1G"}, {"q": "1Gi"})
    assert not contains({"flag": 1}, {"flag": True}) and not contains({"s": "x"}, {"s": "y"})
