"""The chaos bench's attacks on the stage workers' API (the security review's, made repeatable).

An attacker on the cluster network, against every stage worker:

* **poisoning**: `POST /v1/forward` with `save: true` over each stored prefix of the tenant (random hidden
  states on stages after the first), then `POST /v1/flush`, so that garbage would be stored under the
  tenant's chunk keys;
* **pool grab**: `POST /v1/restore` reserving 100,000 tokens;
* **cross-tenant reads**: a restore of a stored prefix (it would reveal a hit), `GET /v1/requests/{id}/kv`
  of the attacker's own attempts and `POST /v1/forward` generating as the tenant;
* the rest of the API: `/v1/deliver`, `/v1/info`, `DELETE /v1/requests/{id}`.

Each is sent without credentials and with a wrong bearer token (`unauthenticated`), and the ones that act
for a tenant (restore, forward) also with the cluster's real internal token but no grant, as a caller
that stole the token but cannot make the coordinator's signature (`ungranted`). Every answer below 400
counts as accepted. Afterwards the caller replays the trace: an answer that differs from the healthy
cluster's is a poisoned one.
"""

from __future__ import annotations

from typing import Any

import httpx
import torch

from cacheflow_common.sim.replay import ReplayRequest
from cacheflow_common.transport import frames
from cacheflow_services.local_cluster import LocalCluster
from cacheflow_services.worker.launch import LocalWorker

ATTACKED_PREFIXES = 3  # stored prefixes poisoned per stage
TIMEOUT_S = 60.0


def attack_workers(cluster: LocalCluster, requests: list[ReplayRequest], hidden_size: int) -> dict[str, Any]:
    """Every attack on every worker; how many answers were not refusals, by credential and by attack."""
    prefixes = [r.token_ids[: r.trace.cached_tokens] for r in requests[:ATTACKED_PREFIXES]]
    unauthenticated = [{}, {"Authorization": "Bearer guessed-token"}]
    accepted: dict[str, int] = {}
    sent = 0
    for worker in cluster.workers:
        calls = _calls(worker, cluster.tenant, prefixes, hidden_size)
        for name, (method, path, kwargs, needs_grant) in calls.items():
            credentials = [*unauthenticated, worker.internal_headers] if needs_grant else unauthenticated
            for headers in credentials:
                key = "ungranted" if headers is worker.internal_headers else "unauthenticated"
                status = _status(worker, method, path, headers, kwargs)
                sent += 1
                if status < 400:
                    accepted[f"{key}:{name}"] = accepted.get(f"{key}:{name}", 0) + 1
    return {"sent": sent, "accepted": accepted,
            "unauthenticated_accepted": sum(v for k, v in accepted.items() if k.startswith("unauthenticated")),
            "ungranted_accepted": sum(v for k, v in accepted.items() if k.startswith("ungranted"))}


def _calls(worker: LocalWorker, tenant: str, prefixes: list[list[int]],
           hidden_size: int) -> dict[str, tuple[str, str, dict[str, Any], bool]]:
    """name -> (method, path, request arguments, whether it acts for a tenant)."""
    calls: dict[str, tuple[str, str, dict[str, Any], bool]] = {}
    for i, prefix in enumerate(prefixes):
        hidden = torch.randn(len(prefix), hidden_size) if worker.stage > 0 else None  # [T, hidden]: garbage
        meta = {"request_id": f"evil-{i}", "tenant": tenant, "start": 0, "token_ids": prefix, "save": True}
        calls[f"poison-{i}"] = ("POST", "/v1/forward", _frame(meta, hidden), True)
        restore = {"request_id": f"peek-{i}", "tenant": tenant, "token_ids": prefix, "input": "boundary"}
        calls[f"hit-probe-{i}"] = ("POST", "/v1/restore", {"json": restore}, True)
        calls[f"read-kv-{i}"] = ("GET", f"/v1/requests/peek-{i}/kv", {}, False)
    grab = {"request_id": "grab", "tenant": tenant, "token_ids": prefixes[0], "reserve_tokens": 100_000}
    calls["pool-grab"] = ("POST", "/v1/restore", {"json": grab}, True)
    calls["flush"] = ("POST", "/v1/flush", {}, False)
    calls["deliver"] = ("POST", "/v1/deliver", _frame({"request_id": "evil-0", "finished": True}, None), False)
    calls["info"] = ("GET", "/v1/info", {}, False)
    calls["release"] = ("DELETE", "/v1/requests/evil-0", {}, False)
    return calls


def _frame(meta: dict[str, Any], hidden: torch.Tensor | None) -> dict[str, Any]:
    return {"content": frames.pack(meta, hidden), "headers": {"Content-Type": frames.CONTENT_TYPE}}


def _status(worker: LocalWorker, method: str, path: str, headers: dict[str, str], kwargs: dict[str, Any]) -> int:
    merged = {**kwargs, "headers": {**kwargs.get("headers", {}), **headers}}
    try:
        return httpx.request(method, f"{worker.url}{path}", timeout=TIMEOUT_S, **merged).status_code
    except httpx.HTTPError:
        return 599  # dropped: not accepted
