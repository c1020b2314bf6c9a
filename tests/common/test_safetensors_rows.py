"""A checkpoint's tensors read a block of rows at a time with plain reads (what a fingerprint hashes): the
same values as safetensors' own slices in every file dtype, and a first fingerprint of a large checkpoint
keeps one block resident, not the whole file (measured in a process of its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from cacheflow_common.model.safetensors_rows import SafetensorsRows
from tests.factories import tiny_model

FILE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int64)


@pytest.mark.parametrize("file_dtype", FILE_DTYPES, ids=str)
def test_rows_read_plainly_equal_safetensors_slices(tmp_path: Path, file_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(*shape, generator=gen) * 8).to(file_dtype)
               for name, shape in {"a": (37, 5), "b": (11,), "c": (6, 3, 4)}.items()}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    with (tmp_path / "t.safetensors").open("rb") as f, safe_open(str(tmp_path / "t.safetensors"), "pt") as mapped:
        rows = SafetensorsRows(f)
        for name, t in tensors.items():
            read = rows.reader(name, tuple(t.shape), torch.float32)
            assert read is not None
            for r0, r1 in ((0, 1), (2, 5), (0, t.shape[0]), (t.shape[0] - 1, t.shape[0])):
                assert torch.equal(read(r0, r1), mapped.get_slice(name)[r0:r1].to(torch.float32)), (name, r0, r1)


def test_a_tensor_of_another_shape_or_name_is_left_to_safetensors(tmp_path: Path):
    save_file({"a": torch.zeros(4, 2)}, str(tmp_path / "t.safetensors"))
    with (tmp_path / "t.safetensors").open("rb") as f:
        rows = SafetensorsRows(f)
        assert rows.reader("a", (2, 4), torch.float32) is None and rows.reader("b", (4, 2), torch.float32) is None


FINGERPRINT_PEAK = """
import json, sys, torch
from pathlib import Path
from cacheflow_common.model.config import ModelConfig
from cacheflow_common.model.weights import checkpoint_fingerprint
def memory():
    return {k: int(v.split()[0]) << 10 for k, v in (l.split(":", 1) for l in open("/proc/self/status"))
            if k in ("VmRSS", "VmHWM")}
root = Path(sys.argv[1])
config = ModelConfig.from_dir(root)
before = memory()
checkpoint_fingerprint(root, config, torch.float32)
print(json.dumps({"before": before["VmRSS"], "peak": memory()["VmHWM"]}))
"""


def test_a_first_fingerprint_keeps_one_block_of_a_large_checkpoint_resident(tmp_path: Path):
    model = tiny_model("qwen3", vocab_size=131072, hidden_size=1024, num_layers=1, intermediate_size=64,
                       tie_word_embeddings=True)  # a 512 MiB embedding
    model.save(tmp_path / "model")
    size = (tmp_path / "model" / "model.safetensors").stat().st_size
    del model
    out = subprocess.run([sys.executable, "-c", FINGERPRINT_PEAK, str(tmp_path / "model")], capture_output=True,
                         text=True, check=True, env={"CACHEFLOW_CACHE": str(tmp_path / "cache"), "PATH": ""},
                         cwd=Path(__file__).resolve().parents[2]).stdout
    grown = json.loads(out)["peak"] - json.loads(out)["before"]
    assert grown < size / 2, f"hashing a {size >> 20} MiB checkpoint grew the process by {grown >> 20} MiB"
