"""Rows of a tensor read from a safetensors file with plain reads, not through a memory map.

A fingerprint reads every byte of a checkpoint once. Through safetensors' memory map each page it touches
stays mapped into the process until the file closes, so a first start's resident memory would climb by the
whole checkpoint (140 GB for a large model; clean page cache, but counted in the process's and its
container's working set). Read with `readinto`, only the block being hashed is the process's.

The format: 8 bytes (little-endian header length), a JSON header {name: {"dtype", "shape", "data_offsets":
[begin, end]}}, then the data, each tensor row-major at its offsets from the header's end.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from io import BufferedReader

import torch

FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
               "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
RowReader = Callable[[int, int], torch.Tensor]  # (first row, end row) -> those rows, in the runtime dtype


class SafetensorsRows:
    """An open safetensors file whose tensors are read a range of rows at a time."""

    def __init__(self, file: BufferedReader) -> None:
        self.file = file
        header_len = int.from_bytes(file.read(8), "little")
        self.header: dict[str, dict[str, object]] = json.loads(file.read(header_len))
        self.data_start = 8 + header_len

    def reader(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> RowReader | None:
        """Rows of tensor `name` converted to `dtype`; None unless the file holds it with exactly `shape`, in
        a dtype this module knows (the caller then reads it another way)."""
        entry = self.header.get(name)
        if not isinstance(entry, dict) or entry.get("dtype") not in FILE_DTYPES or entry.get("shape") != list(shape):
            return None
        file_dtype = FILE_DTYPES[str(entry["dtype"])]
        row_bytes = math.prod(shape[1:]) * file_dtype.itemsize
        offsets = entry["data_offsets"]
        assert isinstance(offsets, list)
        first = self.data_start + int(offsets[0])

        def read(r0: int, r1: int) -> torch.Tensor:
            block = bytearray((r1 - r0) * row_bytes)
            self.file.seek(first + r0 * row_bytes)
            if self.file.readinto(block) != len(block):
                raise OSError(f"{self.file.name}: {name} ends before row {r1}")
            rows = torch.frombuffer(block, dtype=file_dtype) if block else torch.empty(0, dtype=file_dtype)
            return rows.view(r1 - r0, *shape[1:]).to(dtype)  # [r1 - r0, *shape[1:]]

        return read
