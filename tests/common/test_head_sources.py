"""Chunks shared across tensor-parallel sizes: a rank's KV heads stored as objects of their own, and read by a
reader that splits the model's heads another way (all of them in one buffer, or a rank's of another size)."""

from __future__ import annotations

import pytest
import torch

from cacheflow_common.errors import BadRequestError
from cacheflow_common.kv.chunk import decode_kv_chunk, read_trailer
from cacheflow_common.kv.keys import HeadRange, chunk_keys, object_name, tenant_salt
from cacheflow_common.model.kv_buffer import KVBuffer
from cacheflow_common.restore.head_sources import splits_in_order
from cacheflow_common.restore.loader import KVLoader
from cacheflow_common.restore.save import put_chunk
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.prefix import cached_prefix_tokens

HEADS, HEAD_DIM, LAYERS, CHUNK, CHUNKS = 4, 8, range(0, 3), 16, 3
TOKENS = list(range(100, 100 + CHUNK * CHUNKS))
KEYS = tuple(chunk_keys(TOKENS, CHUNK, b"salt"))


def _model_kv(seed: int = 0) -> torch.Tensor:
    """The whole model's KV of the prefix, [L, 2, H, N, D]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(LAYERS), 2, HEADS, len(TOKENS), HEAD_DIM, generator=g).to(torch.bfloat16)


def _store_split(store: MemoryStore, kv: torch.Tensor, n: int, *, quant: str = "none",
                 skip: set[str] | None = None) -> None:
    """Store every chunk as the ranks of a tensor-parallel size n would: one object per run of heads."""
    for key in KEYS:
        for run in HeadRange(0, HEADS, HEADS).parts(n):
            name = object_name(key, "kv", LAYERS.start, LAYERS.stop, run)
            if skip and name in skip:
                continue
            part = kv[:, :, run.start : run.stop, key.token_start : key.token_end]  # [L, 2, h, C, D]
            put_chunk(store, key, TOKENS, part, model_fingerprint="fp", layers=LAYERS, dtype="bfloat16",
                      quant=quant, heads=run)


def _loader(store: MemoryStore, heads: HeadRange, *, quant: str = "none") -> KVLoader:
    kv = KVBuffer(layer_start=LAYERS.start, layer_end=LAYERS.stop, num_kv_heads=heads.count, head_dim=HEAD_DIM,
                  capacity=len(TOKENS), dtype=torch.bfloat16)
    return KVLoader(store=store, keys=KEYS, layers=LAYERS, kv=kv, dtype="bfloat16", quant=quant, heads=heads)


def test_a_ranks_heads_as_vllm_splits_them() -> None:
    assert HeadRange.of_rank(8, 2, 1) == HeadRange(4, 8, 8)
    assert HeadRange.of_rank(8, 1, 0).whole
    assert [HeadRange.of_rank(2, 4, r).start for r in range(4)] == [0, 0, 1, 1]  # more ranks than heads: shared
    with pytest.raises(BadRequestError):
        HeadRange.of_rank(6, 4, 0)
    with pytest.raises(BadRequestError):
        HeadRange(2, 2, 4)


def test_names_say_the_heads_unless_all() -> None:
    key = KEYS[0]
    assert object_name(key, "kv", 0, 3) == object_name(key, "kv", 0, 3, HeadRange(0, 4, 4)) == f"{key.hex}.kv.L0-3"
    assert object_name(key, "kv", 0, 3, HeadRange(2, 4, 4)) == f"{key.hex}.kv.L0-3.H2-4"


def test_a_chunk_of_some_heads_says_so_in_every_section() -> None:
    store, kv = MemoryStore(), _model_kv()
    _store_split(store, kv, 2)
    obj = store.read(object_name(KEYS[1], "kv", 0, 3, HeadRange(2, 4, 4)))
    assert obj is not None
    trailer, decoded = decode_kv_chunk(obj)
    assert trailer["heads"] == [2, 4, 4] and read_trailer(obj)["num_kv_heads"] == 2
    assert torch.equal(decoded, kv[:, :, 2:4, CHUNK : 2 * CHUNK])


@pytest.mark.parametrize(("stored", "reader"), [
    (1, HeadRange(2, 4, 4)),  # a TP 2 rank reads what a TP 1 instance stored
    (2, HeadRange(0, 4, 4)),  # a TP 1 instance reads what TP 2 ranks stored
    (4, HeadRange(0, 2, 4)),  # a TP 2 rank reads what TP 4 ranks stored
    (2, HeadRange(3, 4, 4)),  # a TP 4 rank reads what TP 2 ranks stored
    (2, HeadRange(2, 4, 4)),  # the same split: its own objects
])
@pytest.mark.parametrize("mode", ["token", "layer"])
def test_a_reader_takes_its_heads_out_of_another_split(stored: int, reader: HeadRange, mode: str) -> None:
    store, kv = MemoryStore(), _model_kv()
    _store_split(store, kv, stored)
    loader = _loader(store, reader)
    assert loader.absent_chunks() == []
    if mode == "token":
        assert [loader.load_chunk(i) for i in range(CHUNKS)] == [""] * CHUNKS
    else:
        assert [loader.load_layer(layer) for layer in LAYERS] == [""] * len(LAYERS)
    assert torch.equal(loader.kv.data, kv[:, :, reader.start : reader.stop])
    runs = [run for run in HeadRange(0, HEADS, HEADS).parts(stored)
            if run.start < reader.stop and reader.start < run.stop]
    section = 64 + 2 * (HEADS // stored) * CHUNK * HEAD_DIM * 2  # header, then K and V of a run's heads (bfloat16)
    assert loader.bytes_read == CHUNKS * len(LAYERS) * len(runs) * section  # the runs holding its heads, once


def test_int8_chunks_of_another_split_are_dequantized_as_they_land() -> None:
    store, kv = MemoryStore(), _model_kv()
    _store_split(store, kv, 2, quant="int8")
    whole = _loader(store, HeadRange(0, 4, 4), quant="int8")
    assert [whole.load_chunk(i) for i in range(CHUNKS)] == [""] * CHUNKS
    same = MemoryStore()
    _store_split(same, kv, 1, quant="int8")
    reference = _loader(same, HeadRange(0, 4, 4), quant="int8")
    assert [reference.load_chunk(i) for i in range(CHUNKS)] == [""] * CHUNKS
    assert torch.equal(whole.kv.data, reference.kv.data)  # per-row scales: the split changes nothing


def test_a_split_missing_a_run_serves_nothing() -> None:
    store, kv = MemoryStore(), _model_kv()
    _store_split(store, kv, 2, skip={object_name(KEYS[1], "kv", 0, 3, HeadRange(2, 4, 4))})
    loader = _loader(store, HeadRange(0, 4, 4))
    assert loader.absent_chunks() == [1]
    assert [loader.load_chunk(i) for i in range(CHUNKS)] == ["", "absent", ""]
    rank0 = _loader(store, HeadRange(0, 1, 4))  # a TP 4 rank whose heads are all there
    assert rank0.absent_chunks() == []


def test_an_object_under_another_runs_name_is_refused() -> None:
    store, kv = MemoryStore(), _model_kv()
    _store_split(store, kv, 2)
    first, second = (object_name(KEYS[0], "kv", 0, 3, HeadRange(a, a + 2, 4)) for a in (0, 2))
    obj = store.read(first)
    assert obj is not None
    store.put(second, obj)  # heads [0, 2) stored as [2, 4)
    loader = _loader(store, HeadRange(2, 4, 4))
    assert loader.load_chunk(0) == "heads"


def test_layouts_cost_the_fewest_bytes_first() -> None:
    assert splits_in_order(HeadRange(0, 4, 4)) == [1, 2, 4]
    assert splits_in_order(HeadRange(2, 4, 4)) == [2, 4, 1]
    assert splits_in_order(HeadRange(3, 4, 4)) == [4, 2, 1]


@pytest.mark.parametrize(("stored", "split"), [(1, 2), (2, 1), (4, 2), (2, 2)])
def test_the_lookup_finds_chunks_of_any_split(stored: int, split: int) -> None:
    store = MemoryStore()
    salted_keys = chunk_keys(TOKENS, CHUNK, tenant_salt("fp", "t"))
    kv = _model_kv()
    for key in salted_keys:
        for run in HeadRange(0, HEADS, HEADS).parts(stored):
            if key.index == 2 and run.start == 0:
                continue  # the last chunk lacks a run: not found
            put_chunk(store, key, TOKENS, kv[:, :, run.start : run.stop, key.token_start : key.token_end],
                      model_fingerprint="fp", layers=LAYERS, dtype="bfloat16", heads=run)
    found = cached_prefix_tokens(TOKENS, fingerprint="fp", tenant="t", chunk_size=CHUNK, stage_layers=[LAYERS],
                                 store=store, limit=len(TOKENS), kv_heads=HEADS, head_split=split)
    assert found == 2 * CHUNK
    alone = cached_prefix_tokens(TOKENS, fingerprint="fp", tenant="t", chunk_size=CHUNK, stage_layers=[LAYERS],
                                 store=store, limit=len(TOKENS))  # no heads known: its own objects only
    assert alone == (2 * CHUNK if stored == 1 else 0)
