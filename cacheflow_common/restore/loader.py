"""The I/O side of a restore: read chunk objects (or one layer's section of each) and land them in the KV buffer.

It moves bytes only (store reads into a reusable staging buffer, numpy copies into the buffer): no
torch ops, so it does not fight the forward pass for torch's thread pool on the same cores.
A load returns "" on success or the reason it missed; a miss writes nothing the compute side relies on.
"""

from __future__ import annotations

import numpy as np
import torch

from cacheflow_common.errors import ConfigError
from cacheflow_common.kv.chunk import ChunkLayout, land_kv_sections
from cacheflow_common.kv.keys import ChunkKey, object_name
from cacheflow_common.model.kv_buffer import KVBuffer
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
        if kv.data.device.type != "cpu":
            raise ConfigError(f"KV buffers on {kv.data.device} are not supported yet: restore into CPU memory")
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
        # [n_buf_layers, 2, Hkv, capacity, D * itemsize] bytes, sharing memory with kv.data
        self._dst: np.ndarray = kv.data.view(torch.uint8).numpy()
        largest = max((lay.sections_size for lay in self.layouts), default=0)
        self._staging = memoryview(bytearray(max(largest, sum(lay.section_size for lay in self.layouts))))
        self.bytes_read = 0

    def names(self, index: int) -> str:
        return object_name(self.keys[index], "kv", self.layers.start, self.layers.stop)

    def load_chunk(self, index: int) -> str:
        """Token mode: every layer of chunk `index` in one read. Returns "" or the miss reason."""
        layout = self.layouts[index]
        buf = self._staging[: layout.sections_size]
        if not self.store.read_into(self.names(index), buf, 0):
            return "absent"
        self.bytes_read += len(buf)
        check = land_kv_sections(
            buf,
            layout=layout,
            key=self.keys[index],
            layers=self.layers,
            dst=self._dst,
            dst_layer_start=self.kv.layer_start,
            token_start=self.keys[index].token_start,
        )
        return "" if check.ok else check.reason

    def load_layer(self, layer: int) -> str:
        """Layer mode: layer `layer` of every chunk, one ranged read per chunk. Returns "" or the miss reason."""
        offset = 0
        spans: list[tuple[int, memoryview]] = []
        for i, layout in enumerate(self.layouts):
            buf = self._staging[offset : offset + layout.section_size]
            if not self.store.read_into(self.names(i), buf, layout.section_offset(layer)):
                return "absent"
            self.bytes_read += len(buf)
            spans.append((i, buf))
            offset += layout.section_size
        for i, buf in spans:
            check = land_kv_sections(
                buf,
                layout=self.layouts[i],
                key=self.keys[i],
                layers=range(layer, layer + 1),
                dst=self._dst,
                dst_layer_start=self.kv.layer_start,
                token_start=self.keys[i].token_start,
            )
            if not check.ok:
                return check.reason
        return ""

    def chunk_bytes(self, index: int) -> int:
        return self.layouts[index].sections_size

    def layer_bytes(self) -> int:
        return sum(lay.section_size for lay in self.layouts)
