"""What a load costs end to end: a restore's loader (`KVLoader`) reading chunk objects from a real pod
into a KV buffer, unshaped on loopback, its throughput and the CPU it takes in the pod and in the
loader's process; an idle pod's CPU; a memcpy of the same bytes as the yardstick.

CPU is read from the kernel's accounting (`/proc/<pid>/stat` for the pod, `time.process_time()` for
this process, all threads), so it counts every thread the data plane runs, NIXL's included. Plain
loopback TCP with no CacheFlow code (`socket_ceiling`) is measured beside it: what the kernel's socket
copies cost here bounds what any TCP loader can do.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import numpy as np
import torch

from cacheflow_common.kv.chunk import encode_kv_chunk
from cacheflow_common.kv.keys import ChunkKey, chunk_keys, object_name, tenant_salt
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.store.base import ChunkStore
from cacheflow_services.local_process import cpu_seconds
from cacheflow_services.storage.launch import LocalPod

LAYERS, HEADS, HEAD_DIM = 8, 8, 128  # a chunk of an 8-layer stage of a GQA model: 32 KiB of fp32 KV per token
TOKEN_BYTES = LAYERS * 2 * HEADS * HEAD_DIM * 4


def make_kv_chunk(megabytes: float, seed: int) -> tuple[ChunkKey, str, bytes]:
    """A real kv chunk object of about `megabytes` MB (pods accept only valid chunks): key, name, bytes."""
    tokens = max(1, int(megabytes * 1e6 / TOKEN_BYTES))
    ids = [(seed * 1000 + i) % 32000 for i in range(tokens)]
    key = chunk_keys(ids, tokens, tenant_salt("bench", "alpha"))[0]
    kv = torch.randn(LAYERS, 2, HEADS, tokens, HEAD_DIM, generator=torch.Generator().manual_seed(seed))
    obj = encode_kv_chunk(key=key, token_ids=ids, model="bench", layer_start=0, kv=kv, dtype="float32")
    return key, object_name(key, "kv", 0, LAYERS), bytes(obj)


def memcpy_cpu_s_per_gb(nbytes: int = 64 << 20, seconds: float = 1.0) -> float:
    """CPU seconds per GB of one single-threaded copy between two warm buffers (numpy's memcpy)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm: both buffers' pages faulted in
    copies, began = 0, time.process_time()
    while time.process_time() - began < seconds:
        np.copyto(dst, src)
        copies += 1
    return (time.process_time() - began) / (copies * nbytes / 1e9)


def loader_run(pod: LocalPod, client: ChunkStore, transport: str, megabytes: float, min_reads: int = 3,
               seconds: float = 1.5) -> dict[str, Any]:
    """One loader reading one chunk object again and again into a KV buffer (verified and landed):
    throughput, and CPU seconds per GB in the pod, in the loader's process, and both."""
    key, name, obj = make_kv_chunk(megabytes, seed=int(megabytes * 10) + 1)
    client.put(name, obj)
    kv = KVBuffer(layer_start=0, layer_end=LAYERS, num_kv_heads=HEADS, head_dim=HEAD_DIM, capacity=key.n_tokens,
                  dtype=torch.float32)
    loader = KVLoader(store=client, keys=(key,), layers=range(LAYERS), kv=kv, dtype="float32", quant="none")
    staging = memoryview(bytearray(loader.staging_bytes))
    if loader.load_chunk(0, staging):  # warm-up: connection, buffers, the pod's layout cache
        raise RuntimeError(f"benchmark load of {name} missed")
    assert pod.proc is not None
    pod_cpu, own_cpu, began = cpu_seconds(pod.proc.pid), time.process_time(), time.perf_counter()
    reads = 0
    while reads < min_reads or time.perf_counter() - began < seconds:
        if loader.load_chunk(0, staging):
            raise RuntimeError(f"benchmark load of {name} missed")
        reads += 1
    wall = time.perf_counter() - began
    gigabytes = reads * loader.chunk_bytes(0) / 1e9
    pod_s, loader_s = cpu_seconds(pod.proc.pid) - pod_cpu, time.process_time() - own_cpu
    return {"transport": transport, "chunk_mb": loader.chunk_bytes(0) / 1e6, "reads": reads,
            "gbytes_per_s": gigabytes / wall, "pod_cpu_s_per_gb": pod_s / gigabytes,
            "loader_cpu_s_per_gb": loader_s / gigabytes, "cpu_s_per_gb": (pod_s + loader_s) / gigabytes}


def socket_ceiling(nbytes: int = 64 << 20, rounds: int = 10, piece: int = 1 << 20) -> dict[str, float]:
    """What plain loopback TCP moves with no CacheFlow code at all: one sender thread `sendall`s `nbytes`
    in `piece`s, one receiver `recv_into`s them, in this process; GB/s and CPU seconds per GB (both sides).
    The ceiling a TCP loader cannot pass on this host."""
    src, dst = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8), np.empty(nbytes, np.uint8)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        sender = threading.Thread(target=_send_rounds, args=(listener, src.data, rounds + 1, piece), daemon=True)
        sender.start()
        with socket.create_connection(listener.getsockname()) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            out = dst.data
            _receive_round(sock, out)  # warm-up
            cpu, began = time.process_time(), time.perf_counter()
            for _ in range(rounds):
                _receive_round(sock, out)
            wall, cpu = time.perf_counter() - began, time.process_time() - cpu
        sender.join(10)
    gigabytes = rounds * nbytes / 1e9
    return {"gbytes_per_s": gigabytes / wall, "cpu_s_per_gb": cpu / gigabytes}


def _send_rounds(listener: socket.socket, data: memoryview, rounds: int, piece: int) -> None:
    conn, _ = listener.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(rounds):
            conn.recv(1)  # the receiver asks for the next round
            for at in range(0, len(data), piece):
                conn.sendall(data[at : at + piece])


def _receive_round(sock: socket.socket, out: memoryview) -> None:
    sock.sendall(b"n")
    got = 0
    while got < len(out):
        got += sock.recv_into(out[got:])
