"""The chaos bench's attacks on the stage workers' API (the security reviews', made repeatable).

Every route of the worker's route table (`cacheflow_services.worker.routes.ROUTES`) that needs a grant,
on every stage, is called with every class of credential a caller without the coordinator's word could
have, and each answer below 400 counts as accepted (a cell of `cells`):

* `none`, `wrong`: no bearer token, a guessed one;
* `internal_no_grant`: the cluster's real internal token (stolen) but no grant;
* `other_request`: the token and a real grant the coordinator made for another request;
* `expired`: the token and a real grant for this very call, expired;
* `replay`: the token and a real grant for this call, used once (as the coordinator's call would), then
  sent again; only the second use counts. The calls that act on a tenant's data are the poisoning ones:
  a forward with `save: true` over a stored prefix (random hidden states on stages after the first),
  a restore, a read of KV, a release, a delivery.

Then `strangers`: 40 deliveries of 8 MB each to ids that never come, with the internal token and no grant
or another request's grant: how much the workers grew. Afterwards the caller replays the trace: an answer
that differs from the healthy cluster's is a poisoned one.
"""

from __future__ import annotations

from typing import Any

import httpx
import torch

from cacheflow_bench.abuse import rss_mb
from cacheflow_common.auth import GRANT_HEADER, GrantIssuer, input_digest
from cacheflow_common.sim.replay import ReplayRequest
from cacheflow_common.transport import frames
from cacheflow_services.local_cluster import LocalCluster
from cacheflow_services.worker.launch import LocalWorker
from cacheflow_services.worker.routes import ROUTES, Credential, WorkerRoute, routes_without_grant

CLASSES = ("none", "wrong", "internal_no_grant", "other_request", "expired", "replay")
UNGRANTED = ("internal_no_grant", "other_request", "expired")  # the internal token, and no valid grant
TIMEOUT_S = 60.0
STRANGER_DELIVERIES, STRANGER_BYTES = 40, 8 << 20
Call = tuple[str, str, dict[str, Any], dict[str, Any]]  # method, path, request arguments, the grant's arguments


def attack_workers(cluster: LocalCluster, requests: list[ReplayRequest], hidden_size: int,
                   pod_tokens: dict[str, str]) -> dict[str, Any]:
    """Every credential class on every granted route of every worker; the strangers' deliveries."""
    prefix = requests[0].token_ids[: requests[0].trace.cached_tokens]
    cells = {f"{r.method} {r.path}": dict.fromkeys(CLASSES, 0) for r in ROUTES if r.credential is Credential.GRANT}
    first_uses_refused = 0
    for worker in cluster.workers:
        issuer = worker.issuer(pod_tokens)
        for route in ROUTES:
            if route.credential is not Credential.GRANT:
                continue
            for kind in CLASSES:
                request_id = f"atk-{worker.stage}-{route.op}-{kind}"
                call = _call(route, worker, cluster.tenant, prefix, hidden_size, request_id)
                accepted, first_refused = _attack(worker, issuer, route, call, kind)
                cells[f"{route.method} {route.path}"][kind] += accepted
                first_uses_refused += first_refused
            _release_all(worker, issuer, cluster.tenant, route.op)
    return {"cells": cells, "sent": len(cluster.workers) * len(cells) * len(CLASSES),
            "routes_without_grant": routes_without_grant(),
            "unauthenticated_accepted": sum(c["none"] + c["wrong"] for c in cells.values()),
            "ungranted_accepted": sum(c[k] for c in cells.values() for k in UNGRANTED),
            "replay_accepted": sum(c["replay"] for c in cells.values()),
            "replay_first_uses_refused": first_uses_refused,
            "strangers": stranger_deliveries(cluster, hidden_size, pod_tokens)}


def _call(route: WorkerRoute, worker: LocalWorker, tenant: str, prefix: list[int], hidden_size: int,
          request_id: str) -> Call:
    """The call a route takes for request `request_id`, and what its grant names."""
    path = route.path.replace("{request_id}", request_id)
    own = {"request_id": request_id, "tenant": tenant}
    if route.op == "restore":
        body = {**own, "token_ids": prefix, "input": "boundary"}
        return route.method, path, {"json": body}, {**own, "digest": input_digest(prefix), "max_tokens": len(prefix)}
    if route.op == "forward":  # the poisoning attack: save over a stored prefix from garbage hidden states
        hidden = torch.randn(len(prefix), hidden_size) if worker.stage > 0 else None  # [T, hidden]
        meta = {**own, "start": 0, "token_ids": prefix, "save": True}
        return route.method, path, _frame(meta, hidden), {**own, "digest": input_digest(prefix),
                                                          "max_tokens": len(prefix), "save": True}
    if route.op == "deliver":
        return route.method, path, _frame({"request_id": request_id, "finished": True}, None), {**own, "max_tokens": 1}
    if route.op in ("read", "release"):
        return route.method, path, {}, own
    return route.method, path, {}, {}  # info, flush: about no request


def _attack(worker: LocalWorker, issuer: GrantIssuer, route: WorkerRoute, call: Call, kind: str) -> tuple[int, int]:
    """(1 if the attack was accepted, 1 if a replay's first, legitimate use was refused)."""
    method, path, kwargs, grant = call
    stages = [worker.stage]
    if kind in ("none", "wrong"):
        headers = {} if kind == "none" else {"Authorization": "Bearer guessed-token"}
        return int(_status(worker, method, path, headers, kwargs) < 400), 0
    if kind == "internal_no_grant":
        return int(_status(worker, method, path, worker.internal_headers, kwargs) < 400), 0
    if kind == "other_request":
        other = {**grant, "request_id": "someone-else"} if grant.get("request_id") else {**grant, "request_id": "x"}
        headers = {**worker.internal_headers, GRANT_HEADER: issuer.issue(route.op, stages=stages, **other)}
        return int(_status(worker, method, path, headers, kwargs) < 400), 0
    if kind == "expired":
        headers = {**worker.internal_headers, GRANT_HEADER: issuer.issue(route.op, stages=stages, ttl_s=-60, **grant)}
        return int(_status(worker, method, path, headers, kwargs) < 400), 0
    first = {**grant, "save": False}  # its one use stores nothing: only the replay could
    headers = {**worker.internal_headers, GRANT_HEADER: issuer.issue(route.op, stages=stages, **first)}
    refused_first = int(_status(worker, method, path, headers, kwargs) in (401, 403))
    return int(_status(worker, method, path, headers, kwargs) < 400), refused_first


def _release_all(worker: LocalWorker, issuer: GrantIssuer, tenant: str, op: str) -> None:
    """Free what the accepted first uses opened (a replay's legitimate call holds KV)."""
    for kind in CLASSES:
        request_id = f"atk-{worker.stage}-{op}-{kind}"
        headers = {**worker.internal_headers, GRANT_HEADER: issuer.issue(
            "release", stages=[worker.stage], request_id=request_id, tenant=tenant)}
        _status(worker, "DELETE", f"/v1/requests/{request_id}", headers, {})


def stranger_deliveries(cluster: LocalCluster, hidden_size: int, pod_tokens: dict[str, str]) -> dict[str, Any]:
    """8 MB deliveries to ids that never come, with the internal token and no grant or another id's grant: the
    workers' resident memory before and after (nothing may be held for them)."""
    rows = STRANGER_BYTES // (4 * hidden_size)
    pids = [w.proc.pid for w in cluster.workers if w.proc is not None]
    before = {pid: rss_mb(pid) for pid in pids}
    accepted = 0
    for i in range(STRANGER_DELIVERIES):
        worker = cluster.workers[-1]
        body = _frame({"request_id": f"stranger-{i}", "index": 0}, torch.randn(rows, hidden_size))
        grant = worker.issuer(pod_tokens).issue("deliver", stages=[worker.stage], request_id=f"other-{i}",
                                                tenant=cluster.tenant, max_tokens=rows)
        headers = worker.internal_headers if i % 2 else {**worker.internal_headers, GRANT_HEADER: grant}
        accepted += _status(worker, "POST", "/v1/deliver", headers, body) < 400
    growth = max(rss_mb(pid) - before[pid] for pid in pids)
    return {"sent": STRANGER_DELIVERIES, "bytes_each": rows * hidden_size * 4, "accepted": accepted,
            "memory_growth_mb": round(growth, 1)}


def _frame(meta: dict[str, Any], hidden: torch.Tensor | None) -> dict[str, Any]:
    return {"content": frames.pack(meta, hidden), "headers": {"Content-Type": frames.CONTENT_TYPE}}


def _status(worker: LocalWorker, method: str, path: str, headers: dict[str, str], kwargs: dict[str, Any]) -> int:
    merged = {**kwargs, "headers": {**kwargs.get("headers", {}), **headers}}
    try:
        return httpx.request(method, f"{worker.url}{path}", timeout=TIMEOUT_S, **merged).status_code
    except httpx.HTTPError:
        return 599  # dropped: not accepted

