"""The I/O side of a restore: read chunk objects (or one layer's section of each) and land them in the KV buffer.

It moves bytes only (store reads into a reusable staging buffer, numpy copies into the buffer): no
torch ops, so it does not fight the forward pass for torch's thread pool on the same cores. A KV
buffer in GPU memory is filled through `DeviceLanding` (pinned host buffer, copy on its own stream).
A load returns "" on success or the reason it missed; a miss writes nothing the compute side relies on.

Several threads may load different units of one request at once (a stage worker's channels), each
with a staging buffer of its own (`staging`, at least `staging_bytes` long); without one, the loader's
own buffer is used, which only one thread may do at a time.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.kv.chunk import TRAILER_TAIL, ChunkLayout, land_kv_sections
from cacheflow_common.kv.keys import ChunkKey, object_name
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.restore.device_landing import DeviceLanding
from cacheflow_common.store.base import ChunkStore


class KVLoader:
    """Loads the KV of one request's chunks for one stage's layers from a store into a KV buffer."""

    def __init__(
        self,
        *,
        store: ChunkStore,
        keys: tuple[ChunkKey, ...],
        layers: range,
        kv: KVBuffer,
        dtype: str,
        quant: str,
    ) -> None:
        if kv.data.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"KV buffers on {kv.data.device} are not supported: restore into CPU or CUDA memory")
        self.store = store
        self.keys = keys
        self.layers = layers
        self.kv = kv
        self.layouts = [
            ChunkLayout(
                kind="kv",
                layer_start=layers.start,
                layer_end=layers.stop,
                n_tokens=k.token_end - k.token_start,
                num_kv_heads=kv.data.shape[2],
                head_dim=kv.data.shape[4],
                dtype=dtype,
                quant=quant,
            )
            for k in keys
        ]
        largest = max((lay.sections_size for lay in self.layouts), default=0)
        self.staging_bytes = max(largest, sum(lay.section_size for lay in self.layouts))
        self._staging = memoryview(bytearray(self.staging_bytes))
        self._lock = threading.Lock()  # bytes_read, and the device landing's one pinned buffer
        # CPU: land straight into kv.data, [n_buf_layers, 2, Hkv, capacity, D * itemsize] bytes sharing its memory.
        # GPU: land in a pinned host buffer, then copy to the device.
        self._device = DeviceLanding(kv, self._landed_bytes()) if kv.data.is_cuda else None
        self.bytes_read = 0

    def absent_chunks(self) -> list[int]:
        """Chunks the store does not hold whole: absent, or too short for their sections and a trailer
        (truncated). A layer-wise restore reads every chunk for each layer, so one such chunk would fail
        every layer load (after reading the others for nothing) and recompute everything: over a prefix
        with holes, restore token-wise, which recomputes only the holes."""
        return [i for i in range(len(self.keys)) if not self._whole(i)]

    def _whole(self, index: int) -> bool:
        size = self.store.size(self.names(index))
        return size is not None and size >= self.layouts[index].sections_size + TRAILER_TAIL.size

    def names(self, index: int) -> str:
        return object_name(self.keys[index], "kv", self.layers.start, self.layers.stop)

    def load_chunk(self, index: int, staging: memoryview | None = None) -> str:
        """Token mode: every layer of chunk `index` in one read. Returns "" or the miss reason."""
        layout = self.layouts[index]
        buf = (self._staging if staging is None else staging)[: layout.sections_size]
        if not self.store.read_into(self.names(index), buf, 0):
            return "absent"
        self._count(len(buf))
        key = self.keys[index]
        if self._device is None:
            return self._landed(buf, layout, key, self._host_kv(), key.token_start)
        with self._lock:
            reason = self._landed(buf, layout, key, self._device.tokens_target(layout.n_tokens), 0)
            if not reason:
                self._device.push_tokens(key.token_start, key.token_end)
        return reason

    def _landed(self, buf: memoryview, layout: ChunkLayout, key: ChunkKey, dst: np.ndarray, token_start: int) -> str:
        check = land_kv_sections(buf, layout=layout, key=key, layers=self.layers, dst=dst,
                                 dst_layer_start=self.kv.layer_start, token_start=token_start)
        return "" if check.ok else check.reason

    def load_layer(self, layer: int, staging: memoryview | None = None) -> str:
        """Layer mode: layer `layer` of every chunk, one ranged read per chunk. Returns "" or the miss reason."""
        staging = self._staging if staging is None else staging
        offset = 0
        spans: list[tuple[int, memoryview]] = []
        for i, layout in enumerate(self.layouts):
            buf = staging[offset : offset + layout.section_size]
            if not self.store.read_into(self.names(i), buf, layout.section_offset(layer)):
                return "absent"
            self._count(len(buf))
            spans.append((i, buf))
            offset += layout.section_size
        if self._device is not None:
            with self._lock:
                return self._land_layer(layer, spans)
        return self._land_layer(layer, spans)

    def _count(self, n_bytes: int) -> None:
        with self._lock:
            self.bytes_read += n_bytes

    def _land_layer(self, layer: int, spans: list[tuple[int, memoryview]]) -> str:
        n_tokens = self.keys[-1].token_end
        dst, dst_layer_start = (self._host_kv(), self.kv.layer_start) if self._device is None else (
            self._device.layer_target(n_tokens), layer)
        for i, buf in spans:
            check = land_kv_sections(buf, layout=self.layouts[i], key=self.keys[i], layers=range(layer, layer + 1),
                                     dst=dst, dst_layer_start=dst_layer_start, token_start=self.keys[i].token_start)
            if not check.ok:
                return check.reason
        if self._device is not None:
            self._device.push_layer(layer, n_tokens)
        return ""

    def _landed_bytes(self) -> int:
        """The largest unit once dequantized: one chunk of every layer, or one layer of every chunk."""
        _, _, heads, _, head_dim = self.kv.data.shape
        per_token_layer = 2 * heads * head_dim * self.kv.data.element_size()
        longest_chunk = max((k.token_end - k.token_start for k in self.keys), default=0)
        n_tokens = self.keys[-1].token_end if self.keys else 0
        return per_token_layer * max(len(self.layers) * longest_chunk, n_tokens)

    def _host_kv(self) -> np.ndarray:
        """uint8 [n_buf_layers, 2, Hkv, capacity, D * itemsize] sharing memory with a CPU `kv.data`."""
        return self.kv.data.view(torch.uint8).numpy()

    def chunk_bytes(self, index: int) -> int:
        return self.layouts[index].sections_size

    def layer_bytes(self) -> int:
        return sum(lay.section_size for lay in self.layouts)
