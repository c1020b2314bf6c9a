"""A prefix a stage fails to restore costs the request only the part from the failing chunk on: with the
boundary activations gone (the stages restore pipelined, stage 1 fed by stage 0) and one of stage 1's
chunk objects corrupt while `load-only` has stage 0 load every chunk, stage 1 can neither load that
chunk nor compute it. The pod drops the corrupt copy as it finds it, so the coordinator looks the prefix
up again and restores the chunks before it, prefilling the rest; with the first chunk corrupt nothing is
left, and the whole prompt is prefilled. Either way the answer is the same (real storage pods, stage
workers and a coordinator on loopback)."""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest

from cacheflow_common.kv.keys import chunk_keys, object_name, tenant_salt
from cacheflow_services.local_cluster import LocalCluster

CHUNK = 32  # small_cluster's
WHOLE_CHUNKS = 4


def _stored(local: LocalCluster, pattern: str) -> list[Path]:
    roots = {Path(p.log_path).parent for p in local.pods}
    return [f for root in roots for f in root.rglob(pattern) if f.is_file()]


def _stage_1_object(local: LocalCluster, prompt: list[int], chunk: int) -> Path:
    """The file of stage 1's KV of chunk `chunk` of `prompt`."""
    worker = local.workers[1]
    info = httpx.get(f"{worker.url}/v1/info", headers=worker.granted_headers("info"), timeout=60).json()
    keys = chunk_keys(prompt, CHUNK, tenant_salt(info["model"], local.tenant))
    found = _stored(local, f"{object_name(keys[chunk], 'kv', *info['layers'])}*")
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("corrupt", [2, 0])
def test_a_prefix_restored_up_to_a_chunk_no_stage_can_restore_answers_the_same(local, client, corrupt):
    rng = random.Random(corrupt)
    prompt = [rng.randrange(300) for _ in range(WHOLE_CHUNKS * CHUNK + 7)]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
    first = client.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    for worker in local.workers:
        worker.flush(60)
    for hidden in _stored(local, "*.hidden.L*"):
        hidden.unlink()
    damaged = _stage_1_object(local, prompt, corrupt)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the section's checksum fails, the read is a miss
    damaged.write_bytes(bytes(data))
    again = client.post("/v1/completions", json=body | {"policy": "load-only"})
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["token_ids"] == first.json()["choices"][0]["token_ids"]
    assert again.json()["cacheflow"]["prompt_tokens_restored"] == corrupt * CHUNK  # the chunks before it
