"""Replaying trace requests through a coordinator: store their cached prefixes once, then send them at
their arrival times (one thread each) and collect the coordinator's timings. The batch benchmark and
`cacheflow demo` both use it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from cacheflow_common.sim import percentile
from cacheflow_common.sim.replay import ReplayRequest
from cacheflow_services.http_server import http_client

if TYPE_CHECKING:
    from cacheflow_services.worker.launch import LocalWorker

TIMEOUT_S = 600.0


def warm_up(url: str, token: str, model: str, requests: list[ReplayRequest], workers: Sequence[LocalWorker],
            on_done: Callable[[], None] | None = None) -> None:
    """Store every request's cached prefix (prefill it once), then wait until the workers stored it all."""
    with http_client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=TIMEOUT_S) as client:
        for r in requests:
            prefix = r.token_ids[: r.trace.cached_tokens + 1]
            client.post("/v1/completions", json={"model": model, "prompt": prefix, "max_tokens": 1}).raise_for_status()
            if on_done:
                on_done()
    for worker in workers:
        worker.flush(TIMEOUT_S)


def restore_alone(url: str, token: str, request: ReplayRequest, policy: str) -> float:
    """Seconds one request's cached prefix takes to restore by itself under `policy` (the restore API: the
    prefix restored on every stage and held, then released). A completion under compute-only restores
    nothing (it prefills its whole prompt, as vLLM does on a miss); this measures the restore path."""
    prefix = request.token_ids[: request.trace.cached_tokens]
    with http_client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=TIMEOUT_S) as client:
        started = client.post("/v1/restore", json={"token_ids": prefix, "policy": policy})
        started.raise_for_status()
        rid = started.json()["id"]
        record = client.get(f"/v1/restore/{rid}", params={"wait": TIMEOUT_S}).json()
        client.delete(f"/v1/restore/{rid}")
    if record["state"] != "ready":
        raise ReplayError(f"restore {rid} under {policy} ended {record['state']}: {record['error']}")
    return float(record["restore_s"])


class Replayer(Protocol):
    """`replay`'s signature (the demo takes a stand-in in its tests)."""

    def __call__(self, url: str, token: str, model: str, requests: list[ReplayRequest], policy: str,
                 on_done: Callable[[], None] | None = None) -> list[dict[str, Any]]: ...


def replay(url: str, token: str, model: str, requests: list[ReplayRequest], policy: str,
           on_done: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Send each request at its arrival time with `save: false`; the coordinator's timings per request
    (ReplayError, with the coordinator's answers, if any failed)."""
    results = replay_outcomes(url, token, model, requests, policy, on_done=on_done)
    if failed := [r for r in results if "error" in r]:
        raise ReplayError(f"{policy}: requests {[r['request'] for r in failed]} failed: "
                          + "; ".join(f"{r['request']}: {r['error']}" for r in failed))
    return results


def replay_outcomes(url: str, token: str, model: str, requests: list[ReplayRequest], policy: str, *,
                    max_tokens: int = 1, on_done: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """`replay`, but a failed request is a result too: {"request", "arrival_s", "answered_s", "error"}; the
    others also carry the tokens generated (greedy, `max_tokens` of them). `answered_s`: when the answer
    came, in seconds since the replay began."""
    began = time.monotonic()

    def send(r: ReplayRequest) -> dict[str, Any]:
        time.sleep(max(0.0, began + r.trace.arrival_s - time.monotonic()))
        outcome: dict[str, Any] = {"request": r.trace.request_id, "arrival_s": r.trace.arrival_s,
                                   "sent_s": time.monotonic() - began}
        body = {"model": model, "prompt": r.token_ids, "max_tokens": max_tokens, "policy": policy, "save": False,
                "ignore_eos": True}
        try:
            resp = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"},
                              timeout=TIMEOUT_S)
        except httpx.HTTPError as exc:
            return outcome | {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            outcome["answered_s"] = time.monotonic() - began
            if on_done:
                on_done()
        if resp.status_code != 200:
            return outcome | {"error": f"HTTP {resp.status_code}: {resp.text[:300]}"}
        answer = resp.json()
        extra = answer["cacheflow"]
        return outcome | {"tokens": r.trace.input_length, "restored": extra["prompt_tokens_restored"],
                          "ttft_s": extra["ttft_s"], "restore_s": extra["restore_s"], "lookup_s": extra["lookup_s"],
                          "queue_s": extra["queue_s"], "batch": extra["batch"],
                          "units_computed": [s["computed"] for s in extra["stages"]],
                          "units_loaded": [s["loaded"] for s in extra["stages"]],
                          "token_ids": answer["choices"][0]["token_ids"]}

    with ThreadPoolExecutor(max_workers=max(1, len(requests))) as senders:
        return list(senders.map(send, requests))


class ReplayError(RuntimeError):
    """Some replayed requests failed; the message holds the coordinator's answers."""


def ttft_stats(ttfts: Sequence[float]) -> dict[str, float]:
    xs = sorted(ttfts)
    return {"mean_s": sum(xs) / len(xs), "p50_s": percentile(xs, 50), "p90_s": percentile(xs, 90),
            "p99_s": percentile(xs, 99)}
