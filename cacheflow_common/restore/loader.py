"""The I/O side of a restore: read chunk objects (or one layer's section of each) and land them in the KV buffer.

It moves bytes only: no torch ops, so it does not fight the forward pass for torch's thread pool on the
same cores. An unquantized chunk bound for a CPU buffer lands where it belongs as it is read: the store
scatters each section's payload straight into the buffer's rows (`readv_into`; over TCP the kernel
copies it there), its header into a small staging area, and the section is checked in place. Others
(int8 chunks, dequantized on landing; a KV buffer in GPU memory, filled through `DeviceLanding`: pinned
host buffer, copy on its own stream; a buffer with a landing of its own, `KVBuffer.landing`) are read into a
staging buffer, checked, then copied.

A load returns "" on success or the reason it missed. A miss leaves its unit's rows holding whatever
arrived, which nothing reads: the unit is not loaded, so it is recomputed (which overwrites them), and
attention reads only units that are loaded or computed.

Several threads may load different units of one request at once (a stage worker's channels), each
with a staging buffer of its own (`staging`, at least `staging_bytes` long); without one, the loader's
own buffer is used (allocated on first use), which only one thread may do at a time.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.kv.chunk import (
    SECTION_HEADER_SIZE,
    TRAILER_TAIL,
    ChunkLayout,
    kv_landing_views,
    land_kv_sections,
    verify_landed,
)
from cacheflow_common.kv.keys import ChunkKey, object_name
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.restore.device_landing import DeviceLanding
from cacheflow_common.store.base import ChunkStore


def staging_buffer(nbytes: int) -> memoryview:
    """A staging buffer of `nbytes`, not zero-filled (a load writes every byte it then reads)."""
    return np.empty(nbytes, np.uint8).data  # [nbytes]


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
        # CPU: land straight into kv.data, [n_buf_layers, 2, Hkv, capacity, D * itemsize] bytes sharing its memory.
        # GPU: land in a pinned host buffer, then copy to the device. A buffer may say where its KV lands instead.
        landed = self._landed_bytes()
        self._staged = kv.landing(landed) or (DeviceLanding(kv, landed) if kv.data.is_cuda else None)
        self.direct = self._staged is None and quant == "none"  # read straight into kv.data's rows
        self.staging_bytes = self._staging_needed()
        self._staging: memoryview | None = None  # the loader's own, for callers that bring none
        self._lock = threading.Lock()  # bytes_read, and the device landing's one pinned buffer
        self.bytes_read = 0

    def _staging_needed(self) -> int:
        """Bytes of staging one load needs: the section headers when it lands directly, else whole units."""
        most_sections = max(len(self.layers), len(self.keys))
        if self.direct:
            return SECTION_HEADER_SIZE * most_sections
        largest = max((lay.sections_size for lay in self.layouts), default=0)
        return max(largest, sum(lay.section_size for lay in self.layouts))

    def _staging_of(self, staging: memoryview | None) -> memoryview:
        if staging is not None:
            return staging
        if self._staging is None:
            self._staging = staging_buffer(self.staging_bytes)
        return self._staging

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
        if self.direct:
            return self._load_direct(index, list(self.layers), self._staging_of(staging), 0)
        buf = self._staging_of(staging)[: layout.sections_size]
        if not self.store.read_into(self.names(index), buf, 0):
            return "absent"
        self._count(len(buf))
        key = self.keys[index]
        if self._staged is None:
            return self._landed(buf, layout, key, self._host_kv(), key.token_start)
        with self._lock:
            reason = self._landed(buf, layout, key, self._staged.tokens_target(layout.n_tokens), 0)
            if not reason:
                self._staged.push_tokens(key.token_start, key.token_end)
        return reason

    def _landed(self, buf: memoryview, layout: ChunkLayout, key: ChunkKey, dst: np.ndarray, token_start: int) -> str:
        check = land_kv_sections(buf, layout=layout, key=key, layers=self.layers, dst=dst,
                                 dst_layer_start=self.kv.layer_start, token_start=token_start)
        return "" if check.ok else check.reason

    def _load_direct(self, index: int, layers: list[int], headers: memoryview, offset: int) -> str:
        """Read the sections of `layers` (consecutive) of chunk `index`, from byte `offset` of its object,
        straight into the KV buffer's rows, then check them in place; headers go to `headers`."""
        layout, key, dst = self.layouts[index], self.keys[index], self._host_kv()
        sections = [kv_landing_views(layout, layer, dst, self.kv.layer_start, key.token_start,
                                     headers[i * SECTION_HEADER_SIZE :]) for i, layer in enumerate(layers)]
        if not self.store.readv_into(self.names(index), [v for views in sections for v in views], offset):
            return "absent"
        self._count(layout.section_size * len(layers))
        for layer, views in zip(layers, sections, strict=True):
            check = verify_landed(views, layout=layout, layer=layer, key=key)
            if not check.ok:
                return check.reason
        return ""

    def load_layer(self, layer: int, staging: memoryview | None = None) -> str:
        """Layer mode: layer `layer` of every chunk, one ranged read per chunk. Returns "" or the miss reason."""
        staging = self._staging_of(staging)
        if self.direct:
            for i, layout in enumerate(self.layouts):
                reason = self._load_direct(i, [layer], staging, layout.section_offset(layer))
                if reason:
                    return reason
            return ""
        offset = 0
        spans: list[tuple[int, memoryview]] = []
        for i, layout in enumerate(self.layouts):
            buf = staging[offset : offset + layout.section_size]
            if not self.store.read_into(self.names(i), buf, layout.section_offset(layer)):
                return "absent"
            self._count(len(buf))
            spans.append((i, buf))
            offset += layout.section_size
        if self._staged is not None:
            with self._lock:
                return self._land_layer(layer, spans)
        return self._land_layer(layer, spans)

    def _count(self, n_bytes: int) -> None:
        with self._lock:
            self.bytes_read += n_bytes

    def _land_layer(self, layer: int, spans: list[tuple[int, memoryview]]) -> str:
        n_tokens = self.keys[-1].token_end
        dst, dst_layer_start = (self._host_kv(), self.kv.layer_start) if self._staged is None else (
            self._staged.layer_target(n_tokens), layer)
        for i, buf in spans:
            check = land_kv_sections(buf, layout=self.layouts[i], key=self.keys[i], layers=range(layer, layer + 1),
                                     dst=dst, dst_layer_start=dst_layer_start, token_start=self.keys[i].token_start)
            if not check.ok:
                return check.reason
        if self._staged is not None:
            self._staged.push_layer(layer, n_tokens)
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
