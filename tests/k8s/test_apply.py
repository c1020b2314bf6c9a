"""What the operator sends with server-side apply besides the desired object itself: a live StatefulSet's
immutable spec fields where the desired object would change them (an apply changing them would be refused),
compared the way the API server writes values (quantities canonicalised). The requests themselves (method,
content type, field manager, force, body) are checked against kmock in test_operator_kmock.py."""

from __future__ import annotations

import copy
import logging

from cacheflow_operator.apply import STATEFULSET_MUTABLE, contains, keep_immutable
from cacheflow_operator.manifests.build import children
from cacheflow_operator.spec import Cluster


def cluster(**spec):
    return Cluster.from_resource({"metadata": {"name": "demo", "namespace": "ml", "uid": "u1"}, "spec": spec})


def statefulset(**spec):
    return next(o for o in children(cluster(**spec)) if o["kind"] == "StatefulSet")


def as_served(obj):
    """The object as the API server returns it: defaults added, a status, quantities canonical."""
    live = copy.deepcopy(obj)
    live["metadata"].update(uid="x", resourceVersion="7", generation=1)
    live["spec"]["revisionHistoryLimit"] = 10
    for claim in live["spec"].get("volumeClaimTemplates", []):
        claim["spec"]["volumeMode"] = "Filesystem"
        claim["status"] = {"phase": "Pending"}
    live["status"] = {"replicas": 1}
    return live


def test_an_unchanged_statefulset_is_sent_as_desired():
    want = statefulset()
    assert keep_immutable(want, as_served(want)) is want
    assert keep_immutable(want, None) is want  # not there yet: created as desired


def test_changed_immutable_fields_keep_their_live_values_and_mutable_ones_change(caplog):
    before, after = statefulset(), statefulset(storage={"volumeSize": "100Gi", "pods": 3})
    live = as_served(before)
    with caplog.at_level(logging.WARNING, logger="cacheflow_operator.apply"):
        sent = keep_immutable(after, live)
    assert sent["spec"]["volumeClaimTemplates"] == live["spec"]["volumeClaimTemplates"]  # 20Gi... as it is
    assert sent["spec"]["replicas"] == 3 and sent["spec"]["template"] == after["spec"]["template"]
    assert "volumeClaimTemplates" in caplog.text and "cannot change in place" in caplog.text
    assert after["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "100Gi"  # untouched
    assert {k for k in sent["spec"] if sent["spec"][k] != after["spec"][k]} <= set(sent["spec"]) - STATEFULSET_MUTABLE


def test_other_kinds_are_sent_as_desired():
    for obj in children(cluster()):
        if obj["kind"] != "StatefulSet":
            changed = copy.deepcopy(obj)
            changed["metadata"]["labels"]["x"] = "y"
            assert keep_immutable(obj, changed) is obj


def test_contains_compares_as_the_api_server_writes():
    assert contains({"l": [{"a": 1, "b": 2}]}, {"l": [{"a": 1}]})
    assert not contains({"l": [{"a": 1}, {"a": 2}]}, {"l": [{"a": 1}]})
    assert contains({"q": "1Gi"}, {"q": "1024Mi"}) and not contains({"q": "1G"}, {"q": "1Gi"})
    assert contains({"cpu": "500m"}, {"cpu": "0.5"})
    assert not contains({"flag": 1}, {"flag": True}) and not contains({"s": "x"}, {"s": "y"})

