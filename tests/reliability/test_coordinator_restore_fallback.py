"""A prefix that a stage fails to restore costs the request time, never its answer: the coordinator
prefills the whole prompt instead (real storage pods, stage workers and a coordinator on loopback).

The failure is made for real: the boundary activations are gone (so the stages restore pipelined, stage 1
fed by stage 0) and one of stage 1's chunk objects is corrupt, while `load-only` has stage 0 load every
chunk: stage 1 can neither load that chunk nor compute it (its input was never computed upstream)."""

from __future__ import annotations

import random
from pathlib import Path

import httpx

from cacheflow_services.local_cluster import LocalCluster

CHUNK = 32  # small_cluster's


def _objects(local: LocalCluster, kind: str) -> list[Path]:
    """Every stored object of `kind` ("kv" or "hidden") in the cluster's pods."""
    roots = {Path(p.log_path).parent for p in local.pods}
    return [f for root in roots for f in root.rglob(f"*.{kind}.L*") if f.is_file()]


def test_a_prefix_no_stage_can_restore_is_prefilled_and_answered_the_same(local, client):
    rng = random.Random(3)
    prompt = [rng.randrange(300) for _ in range(4 * CHUNK + 7)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    first = client.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    for worker in local.workers:
        httpx.post(f"{worker.url}/v1/flush", headers=worker.internal_headers, timeout=60).raise_for_status()
    for hidden in _objects(local, "hidden"):
        hidden.unlink()
    stage_1 = sorted(f for f in _objects(local, "kv") if ".kv.L0-" not in f.name)
    assert stage_1, "stage 1 stored no chunk"
    corrupt = stage_1[0]
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the section's checksum fails, the read is a miss
    corrupt.write_bytes(bytes(data))
    again = client.post("/v1/completions", json=body | {"policy": "load-only"})
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["token_ids"] == first.json()["choices"][0]["token_ids"]
    # prefilled from the corrupt chunk on (which chunk: test_coordinator_restore_shortened.py)
    assert again.json()["cacheflow"]["prompt_tokens_restored"] < 4 * CHUNK
