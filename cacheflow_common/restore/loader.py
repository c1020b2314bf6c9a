"""The I/O side of a restore: read chunk objects (or one layer's section of each) and land them in the KV buffer.

It moves bytes only: no torch ops, so it does not fight the forward pass for torch's thread pool on the
same cores. An unquantized chunk lands where it belongs as it is read: the store scatters each section's
payload straight into its rows (`readv_into`; over TCP the kernel copies it there), its header into a small
staging area, and the section is checked in place. The rows are a CPU buffer's own, or, for a buffer the
loader cannot write directly (in GPU memory: `DeviceLanding`, pinned host area, copy on its own stream; one
that says where its loads land: `KVBuffer.landing`), those of a host area shaped like the unit, pushed to the
buffer once checked. int8 chunks are read into staging, checked, then dequantized into the rows.

Under tensor parallelism the buffer holds a rank's KV heads (`heads`), and so do the objects it reads. A
chunk this split of the heads has not stored may be stored split another way (by an instance of another
tensor-parallel size): the loader then takes its heads out of those objects (`head_sources.py`), through
staging, once its own object is found missing.

A load returns "" on success or the reason it missed. A miss leaves its unit's rows holding whatever
arrived, which nothing reads: the unit is not loaded, so it is recomputed (which overwrites them), and
attention reads only units that are loaded or computed.

Several threads may load different units of one request at once (a stage worker's channels), each
with a staging buffer of its own (`staging`, at least `staging_bytes` long: headers only, unless int8) and,
through a landing, a host area of its own; without a staging buffer, the loader's own is used (allocated on
first use), which only one thread may do at a time.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.kv.chunk import (
    SECTION_HEADER_SIZE,
    ChunkLayout,
    kv_landing_views,
    land_kv_sections,
    verify_landed,
)
from cacheflow_common.kv.keys import ChunkKey, HeadRange, object_name
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.restore.device_landing import DeviceLanding
from cacheflow_common.restore.head_sources import HeadPart, split_of, stored_parts
from cacheflow_common.store.base import ChunkStore


def staging_buffer(nbytes: int) -> memoryview:
    """A staging buffer of `nbytes`, not zero-filled (a load writes every byte it then reads)."""
    return np.empty(nbytes, np.uint8).data  # [nbytes]


def as_bytes(kv: torch.Tensor) -> np.ndarray:
    """uint8 [..., D * itemsize] sharing memory with a CPU tensor `kv` [..., D]."""
    return kv.view(torch.uint8).numpy()


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
        heads: HeadRange | None = None,
    ) -> None:
        """`heads`: the model's KV heads the buffer holds (None: all of them)."""
        if kv.data.device.type not in ("cpu", "cuda"):
            raise ConfigError(f"KV buffers on {kv.data.device} are not supported: restore into CPU or CUDA memory")
        self.store = store
        self.keys = keys
        self.layers = layers
        self.kv = kv
        self.heads = heads or HeadRange(0, kv.data.shape[2], kv.data.shape[2])
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
                heads=heads,
            )
            for k in keys
        ]
        self._elsewhere: dict[int, list[HeadPart]] = {}  # chunk -> where its heads are, its own object missing
        # CPU: land straight into kv.data, [n_buf_layers, 2, Hkv, capacity, D * itemsize] bytes sharing its memory.
        # GPU: land in a pinned host buffer, then copy to the device. A buffer may say where its KV lands instead.
        self._staged = kv.landing() or (DeviceLanding(kv) if kv.data.is_cuda else None)
        self.direct = quant == "none"  # sections read straight into their rows (of kv.data, or of a landing area)
        self.staging_bytes = self._staging_needed()
        self._staging: memoryview | None = None  # the loader's own, for callers that bring none
        self._lock = threading.Lock()  # bytes_read
        self.bytes_read = 0

    def _staging_needed(self) -> int:
        """Bytes of staging one load needs: a unit's section headers when it is read in place, else the raw bytes
        of the largest chunk (int8: dequantized from there, one chunk at a time)."""
        if self.direct:
            return SECTION_HEADER_SIZE * len(self.layers)
        return max((lay.sections_size for lay in self.layouts), default=0)

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
        if self.layouts[index].stored_whole(self.store.size(self.names(index))):
            return True
        return self._stored_elsewhere(index) is not None

    def names(self, index: int) -> str:
        return object_name(self.keys[index], "kv", self.layers.start, self.layers.stop, self.heads)

    def _stored_elsewhere(self, index: int) -> list[HeadPart] | None:
        """The objects of another split of the heads that hold chunk `index`'s (None: none is stored)."""
        with self._lock:
            if index in self._elsewhere:
                return self._elsewhere[index]
        parts = stored_parts(self.keys[index], self.layouts[index], self.heads, self.store.size,
                             skip=split_of(self.heads))
        if parts is not None:
            with self._lock:
                self._elsewhere[index] = parts
        return parts

    def load_chunk(self, index: int, staging: memoryview | None = None) -> str:
        """Token mode: every layer of chunk `index` in one read. Returns "" or the miss reason."""
        staging, key = self._staging_of(staging), self.keys[index]
        if self._staged is None:
            return self._chunk_into(index, self._host_kv(), key.token_start, staging)
        with self._staged.tokens_area(key.token_end - key.token_start) as staged:
            reason = self._chunk_into(index, as_bytes(staged), 0, staging)
            if not reason:
                self._staged.push_tokens(staged, key.token_start)
        return reason

    def _chunk_into(self, index: int, dst: np.ndarray, token_start: int, staging: memoryview) -> str:
        """Every layer of chunk `index` into the rows of `dst` (layers from `kv.layer_start`) from `token_start`."""
        return self._read(index, self.layers, dst, self.kv.layer_start, token_start, staging)

    def load_layer(self, layer: int, staging: memoryview | None = None) -> str:
        """Layer mode: layer `layer` of every chunk, one ranged read per chunk. Returns "" or the miss reason."""
        staging = self._staging_of(staging)
        if self._staged is None:
            return self._layer_into(layer, self._host_kv(), self.kv.layer_start, staging)
        with self._staged.layer_area(self.keys[-1].token_end) as staged:
            reason = self._layer_into(layer, as_bytes(staged), layer, staging)
            if not reason:
                self._staged.push_layer(staged, layer)
        return reason

    def _layer_into(self, layer: int, dst: np.ndarray, dst_layer_start: int, staging: memoryview) -> str:
        """Layer `layer` of every chunk into the rows of `dst` (whose layers start at `dst_layer_start`)."""
        for i, key in enumerate(self.keys):
            reason = self._read(i, range(layer, layer + 1), dst, dst_layer_start, key.token_start, staging)
            if reason:
                return reason
        return ""

    def _read(self, index: int, layers: range, dst: np.ndarray, dst_layer_start: int, token_start: int,
              staging: memoryview) -> str:
        """Read the sections of `layers` of chunk `index` into the rows of `dst` from `token_start`: in place
        (unquantized), or through `staging` (int8: dequantized on landing); from another split's objects if
        its own is missing."""
        parts = self._elsewhere.get(index)
        if parts is None:
            read = self._read_in_place if self.direct else self._read_dequantized
            reason = read(index, layers, dst, dst_layer_start, token_start, staging,
                          self.layouts[index].section_offset(layers.start))
            if reason != "absent" or (parts := self._stored_elsewhere(index)) is None:
                return reason
        return self._read_parts(index, parts, layers, dst, dst_layer_start, token_start)

    def _read_parts(self, index: int, parts: list[HeadPart], layers: range, dst: np.ndarray, dst_layer_start: int,
                    token_start: int) -> str:
        """Chunk `index`'s heads out of other objects: each read into a buffer of its own, checked, and its heads
        the reader holds copied into their rows of `dst`."""
        for part in parts:
            buf = staging_buffer(part.layout.section_size * len(layers))
            if not self.store.read_into(part.name, buf, part.layout.section_offset(layers.start)):
                return "absent"
            self._count(len(buf))
            check = land_kv_sections(buf, layout=part.layout, key=self.keys[index], layers=layers,
                                     dst=dst[:, :, part.dst], dst_layer_start=dst_layer_start,
                                     token_start=token_start, take=part.take)
            if not check.ok:
                return check.reason
        return ""

    def _read_dequantized(self, index: int, layers: range, dst: np.ndarray, dst_layer_start: int, token_start: int,
                          staging: memoryview, offset: int) -> str:
        """The raw sections into `staging`, checked there, then dequantized into the rows of `dst`."""
        layout = self.layouts[index]
        buf = staging[: layout.section_size * len(layers)]
        if not self.store.read_into(self.names(index), buf, offset):
            return "absent"
        self._count(len(buf))
        check = land_kv_sections(buf, layout=layout, key=self.keys[index], layers=layers, dst=dst,
                                 dst_layer_start=dst_layer_start, token_start=token_start)
        return "" if check.ok else check.reason

    def _read_in_place(self, index: int, layers: range, dst: np.ndarray, dst_layer_start: int, token_start: int,
                       headers: memoryview, offset: int) -> str:
        """The sections' payloads straight into the rows of `dst`, checked in place; headers go to `headers`."""
        layout, key = self.layouts[index], self.keys[index]
        sections = [kv_landing_views(layout, layer, dst, dst_layer_start, token_start,
                                     headers[i * SECTION_HEADER_SIZE :]) for i, layer in enumerate(layers)]
        if not self.store.readv_into(self.names(index), [v for views in sections for v in views], offset):
            return "absent"
        self._count(layout.section_size * len(layers))
        for layer, views in zip(layers, sections, strict=True):
            check = verify_landed(views, layout=layout, layer=layer, key=key)
            if not check.ok:
                return check.reason
        return ""

    def _count(self, n_bytes: int) -> None:
        with self._lock:
            self.bytes_read += n_bytes

    def _host_kv(self) -> np.ndarray:
        """uint8 [n_buf_layers, 2, Hkv, capacity, D * itemsize] sharing memory with a CPU `kv.data`."""
        return as_bytes(self.kv.data)

    def chunk_bytes(self, index: int) -> int:
        return self.layouts[index].sections_size

    def layer_bytes(self) -> int:
        return sum(lay.section_size for lay in self.layouts)
