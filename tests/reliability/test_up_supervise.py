"""`cacheflow up` heals: a storage pod killed while requests stream costs no request (its chunks are
recomputed, and it comes back on its ports with its chunks), and a killed stage worker is restarted, so
the cluster serves again (real processes: `cacheflow up` with the tiny model)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx

from tests.reliability.up_cluster import (
    CHUNK,
    Up,
    alive,
    cmdline,
    prompt,
    start_up,
    wait_gone,
    write_spec,
)

RECOVERY_S = 60.0  # a generous deadline: the brief's target is 15 s, not asserted on a noisy machine


def _stream(client: httpx.Client, tokens: list[int]) -> str:
    """A streamed completion; "" when it came whole, else what went wrong."""
    with client.stream("POST", "/v1/completions",
                       json={"model": "tiny", "prompt": tokens, "max_tokens": 6, "stream": True}) as r:
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}"
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return f"stream ended without [DONE]: {events[-3:]}"
    if errors := [e for e in events[:-1] if "error" in json.loads(e)]:
        return f"error event: {errors[0]}"
    return ""


def _serving_up(tmp_path: Path, profile: Path) -> Up:
    spec = write_spec(tmp_path / "spec.yaml", profile)
    return start_up(tmp_path, "--spec", str(spec), "--dir", str(tmp_path / "cluster"))


def _store_prefix(client: httpx.Client, tokens: list[int]) -> None:
    """Send `tokens` until its prefix is restored from the pods (the workers store in the background)."""
    for _ in range(60):
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": tokens, "max_tokens": 2})
        assert r.status_code == 200, r.text
        if r.json()["cacheflow"]["prompt_tokens_restored"]:
            return
        time.sleep(0.2)
    raise AssertionError("the prefix was never restored")


def test_a_pod_killed_while_requests_stream_fails_none_and_comes_back_with_its_chunks(tmp_path, quick_profile, ups):
    up = ups(_serving_up(tmp_path, quick_profile))
    up.wait_serving()
    prefix = prompt(8 * CHUNK, seed=1)
    pod_dir = up.workdir / "pod-1"
    pod_ports = up.wait_line(r"^pod 1\s+data (\S+)\s+control (\S+)").groups()
    with up.client() as client:
        _store_prefix(client, [*prefix, 1, 2, 3])
        chunks_before = {p.name for p in (pod_dir / "chunks").rglob("*") if p.is_file()}
        pod = up.child(f"{pod_dir}/")
        failures: list[str] = []  # one entry per request: "" when it succeeded

        def stream_requests(seed: int) -> None:
            for i in range(8):
                try:
                    failures.append(_stream(client, prefix + prompt(5 + i, seed=seed + i)))
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")

        streams = [threading.Thread(target=stream_requests, args=(seed,), daemon=True) for seed in (100, 200)]
        for t in streams:
            t.start()
        while len(failures) < 3 and any(t.is_alive() for t in streams):
            time.sleep(0.05)
        os.kill(pod, signal.SIGKILL)  # two streams at once: one of them is mid-flight
        for t in streams:
            t.join(600)
        assert len(failures) == 16, up.output()
    assert not any(failures), [f for f in failures if f]
    assert f"pod 1 (pid {pod}) exited with signal SIGKILL" in up.wait_stderr("pod 1 is back")
    assert "restarting pod 1 in " in up.stderr() and "(attempt 1 of 5)" in up.stderr()
    back = up.child(f"{pod_dir}/")
    assert back != pod and alive(back)
    data, control = pod_ports  # the same ports: the workers and the coordinator know it by them
    command = cmdline(back)
    assert f"--data-port {data.split(':')[1]} --http-port {control.rsplit(':', 1)[1]}" in command
    assert f"--dir {pod_dir}/chunks" in command
    with httpx.Client(timeout=30) as plain:
        stats = plain.get(f"{control}/healthz")
    assert stats.status_code == 200
    chunks_after = {p.name for p in (pod_dir / "chunks").rglob("*") if p.is_file()}
    assert chunks_before and chunks_before <= chunks_after  # the same directory: its chunks survived


def test_a_killed_worker_is_restarted_and_a_request_sent_meanwhile_waits_for_it(tmp_path, quick_profile, ups):
    up = ups(_serving_up(tmp_path, quick_profile))
    up.wait_serving()
    tokens = prompt(3 * CHUNK + 5, seed=2)
    with up.client() as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": tokens, "max_tokens": 4})
        assert r.status_code == 200, r.text
        expected = r.json()["choices"][0]["token_ids"]
        worker = up.child("worker --stage 1 ")
        os.kill(worker, signal.SIGKILL)
        assert wait_gone([worker]) == []
        killed = time.monotonic()
        # before the first token nothing has reached the client: the coordinator waits for the stage to be
        # back (--stage-wait-s) and tries again, instead of answering 502 or 503
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": tokens, "max_tokens": 4},
                        timeout=RECOVERY_S)
        print(f"served {time.monotonic() - killed:.1f} s after the worker was killed")
        assert r.status_code == 200, f"{r.text}\n{up.output()}"
        assert r.json()["choices"][0]["token_ids"] == expected
    assert up.proc.poll() is None
    stderr = up.wait_stderr("stage 1 is back")
    assert f"stage 1 (pid {worker}) exited with signal SIGKILL" in stderr and "(attempt 1 of 5)" in stderr
    assert up.child("worker --stage 1 ") != worker
