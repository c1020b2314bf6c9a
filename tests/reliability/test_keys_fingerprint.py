"""Chunk keys that cannot collide: a model's fingerprint covers every byte of its weights, is the same on
every stage of one checkpoint, and is hashed once per checkpoint (kept beside the files, hashed again
when a file changes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cacheflow_common.model import fingerprint_cache, weights
from cacheflow_common.model.transformer import Transformer
from cacheflow_common.restore.save import make_job
from tests.factories import tiny_model

PROMPT = [(7 * i + 3) % 384 for i in range(64)]
NEW_TOKEN_ROW = 365  # a row the old fingerprint (16 sampled 4 KB windows per tensor) never read


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of the test's own, and no fingerprint remembered from another test."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CACHEFLOW_CACHE", str(cache))
    monkeypatch.setattr(fingerprint_cache, "_MEMORY", {})
    return cache


def _checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    """A base model and a fine-tune of it that changed one embedding row (a new special token)."""
    model = tiny_model("qwen3", seed=0, num_layers=3)
    model.save(tmp_path / "base")
    model.weights["model.embed_tokens.weight"][NEW_TOKEN_ROW] += 0.5
    model.save(tmp_path / "tuned")
    return tmp_path / "base", tmp_path / "tuned"


def _keys(model: Transformer) -> set[str]:
    return {k.hex for k in make_job(model, PROMPT, tenant="acme", chunk_size=16).keys}


def test_one_changed_embedding_row_gets_its_own_fingerprint_on_every_stage(tmp_path):
    base, tuned = _checkpoints(tmp_path)
    stages = (range(0, 1), range(1, 3))
    base_fps = {Transformer.from_dir(base, layers=layers).fingerprint() for layers in stages}
    tuned_fps = {Transformer.from_dir(tuned, layers=layers).fingerprint() for layers in stages}
    assert len(base_fps) == 1 and len(tuned_fps) == 1  # every stage of a checkpoint agrees
    assert base_fps != tuned_fps
    whole_base, whole_tuned = Transformer.from_dir(base), Transformer.from_dir(tuned)
    assert base_fps == {whole_base.fingerprint()} and not _keys(whole_base) & _keys(whole_tuned)


def test_in_memory_models_fingerprint_every_byte():
    a, b = tiny_model("qwen3", seed=0), tiny_model("qwen3", seed=0)
    b.weights["model.embed_tokens.weight"][NEW_TOKEN_ROW, 7] += 0.25
    assert a.fingerprint() != b.fingerprint()


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    hashed: list[Path] = []
    real = weights._hash_checkpoint

    def counting(*args: Any, **kwargs: Any) -> str:
        hashed.append(next(iter(args[2].values())).parent)
        return real(*args, **kwargs)

    monkeypatch.setattr(weights, "_hash_checkpoint", counting)
    return hashed


def test_the_checkpoint_is_hashed_once_then_again_when_a_file_changes(tmp_path, monkeypatch):
    base, _ = _checkpoints(tmp_path)
    hashed = _count_hashes(monkeypatch)
    first = Transformer.from_dir(base, layers=range(0, 1)).fingerprint()
    assert hashed == [base] and (base / fingerprint_cache.SIDECAR).is_file()
    monkeypatch.setattr(fingerprint_cache, "_MEMORY", {})  # as a new process would start
    assert Transformer.from_dir(base, layers=range(1, 3)).fingerprint() == first
    assert hashed == [base]  # taken from the sidecar
    assert Transformer.from_dir(base, dtype=torch.bfloat16).fingerprint() != first
    assert len(hashed) == 2  # another compute dtype is another fingerprint

    model = Transformer.from_dir(base)
    model.weights["model.layers.2.mlp.down_proj.weight"][0, 0] += 1.0
    model.save(base)  # the same path, new contents
    stat = (base / "model.safetensors").stat()
    os.utime(base / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    changed = Transformer.from_dir(base, layers=range(0, 1)).fingerprint()
    assert changed != first and len(hashed) == 3


def test_a_checkpoint_directory_that_cannot_be_written_keeps_it_in_the_cache_directory(tmp_path, monkeypatch,
                                                                                      fresh_cache):
    base, _ = _checkpoints(tmp_path)
    (base / fingerprint_cache.SIDECAR).mkdir()  # the sidecar cannot be written there
    hashed = _count_hashes(monkeypatch)
    first = Transformer.from_dir(base).fingerprint()
    assert list((fresh_cache / "fingerprints").glob("*.json"))
    monkeypatch.setattr(fingerprint_cache, "_MEMORY", {})
    assert Transformer.from_dir(base, layers=range(2, 3)).fingerprint() == first and hashed == [base]


# A process that fingerprints a checkpoint the moment the test says go; its hash takes a second and gives
# a result of its own, so two that both hashed would print two fingerprints.
HASH_ON_GO = """
import sys, time
from pathlib import Path
from cacheflow_common.model.fingerprint_cache import cached_fingerprint
root, work, name = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
def compute():
    with (work / "hashed.log").open("a") as f:
        f.write(name + "\\n")
    time.sleep(1.0)
    return "fingerprint-of-" + name
(work / ("ready-" + name)).touch()
while not (work / "go").exists():
    time.sleep(0.005)
print(cached_fingerprint(root, [root / "model.safetensors"], "float32", compute))
"""


def test_processes_starting_together_on_a_new_checkpoint_hash_it_once(tmp_path, fresh_cache):
    """vLLM's scheduler and its tensor-parallel ranks start together: one hashes, the others wait and read its
    sidecar (real processes, released at once)."""
    root, work = tmp_path / "checkpoint", tmp_path / "work"
    root.mkdir()
    work.mkdir()
    (root / "model.safetensors").write_bytes(os.urandom(4096))
    env = {**os.environ, "CACHEFLOW_CACHE": str(fresh_cache)}
    procs = [subprocess.Popen([sys.executable, "-c", HASH_ON_GO, str(root), str(work), str(i)],
                              stdout=subprocess.PIPE, text=True, env=env) for i in range(3)]
    deadline = time.monotonic() + 60
    while len(list(work.glob("ready-*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    (work / "go").touch()
    printed = {proc.communicate(timeout=60)[0].strip() for proc in procs}
    assert len((work / "hashed.log").read_text().split()) == 1
    assert len(printed) == 1 and printed.pop().startswith("fingerprint-of-")
