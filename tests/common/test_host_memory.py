"""Chunk-sized host buffers hand their pages back to the system when released (`host_buffer`)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from cacheflow_common.host_memory import MAPPED_MIN_BYTES, host_buffer
from cacheflow_common.kv.chunk import decode_kv_chunk, encode_kv_chunk
from cacheflow_common.kv.keys import chunk_keys, tenant_salt

# Run in a fresh interpreter: a thread there gets an arena of its own, with nothing freed in it before.
KEPT_AFTER_RELEASE = """
import json, os, threading
from cacheflow_common.host_memory import host_buffer

MIB = 1 << 20
kept = {}


def resident():
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(kind):
    warm = bytearray(24 * MIB)  # freed at once: glibc raises its mmap threshold past 16 MiB
    del warm
    before = resident()
    buf = memoryview(bytearray(16 * MIB)) if kind == "heap" else host_buffer(16 * MIB)
    assert not any(buf[::4096])
    buf[::4096] = b"\\x07" * len(range(0, 16 * MIB, 4096))  # touch every page
    del buf
    kept[kind] = (resident() - before) / MIB


for kind in ("heap", "mapped"):
    thread = threading.Thread(target=run, args=(kind,))
    thread.start()
    thread.join()
print(json.dumps(kept))
"""


def test_a_released_large_buffer_returns_its_pages_where_the_heap_keeps_them():
    """In a thread whose arena has seen a larger block freed (as a saver's has), a freed 16 MiB heap block
    stays resident; a released `host_buffer` of that size does not."""
    out = subprocess.run([sys.executable, "-c", KEPT_AFTER_RELEASE], capture_output=True, text=True, check=True)
    kept = json.loads(out.stdout)  # MiB still resident after release, per kind
    assert kept["mapped"] < 2, kept
    assert kept["heap"] > 12, f"the heap handed its block back ({kept}): this test no longer shows the difference"


def test_a_small_buffer_is_a_heap_bytearray():
    buf = host_buffer(MAPPED_MIN_BYTES - 1)
    assert isinstance(buf.obj, bytearray) and len(buf) == MAPPED_MIN_BYTES - 1 and not buf.readonly


def test_a_large_chunk_object_is_mapped_read_only_and_decodes():
    ids = list(range(256))
    key = chunk_keys(ids, 256, tenant_salt("m", "alpha"))[0]
    kv = torch.randn(4, 2, 2, 256, 64)  # [L, 2, Hkv, T, D]: 1 MiB of payload
    obj = encode_kv_chunk(key=key, token_ids=ids, model="m", layer_start=0, kv=kv, dtype="float32")
    assert obj.readonly and len(obj) > MAPPED_MIN_BYTES and not isinstance(obj.obj, bytearray)
    assert torch.equal(decode_kv_chunk(obj)[1], kv)
