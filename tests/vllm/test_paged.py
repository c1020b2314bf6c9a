"""Paged KV layouts and the scheduler's plan (no vLLM needed)."""

from __future__ import annotations

import pytest
import torch

from cacheflow_common.kv.keys import chunk_keys, object_name, tenant_salt
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.prefix import cached_prefix_tokens
from cacheflow_services.vllm_connector.config import ConnectorConfig
from cacheflow_services.vllm_connector.model_identity import salted
from cacheflow_services.vllm_connector.paged import LAYOUTS, draft_layer, gather, layer_index, scatter
from cacheflow_services.vllm_connector.plan import Keying, SchedulerPlan

HEADS, DIM, BS, BLOCKS = 2, 8, 4, 6


def test_cpu_vec_layout_keeps_keys_transposed_within_a_block():
    """vLLM's CPU `vec` kernel: per (block, head), K stored as [D, bs] then V as [bs, D]."""
    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)
    kv = torch.randn(2, HEADS, BS, DIM)  # one whole block
    scatter(cache, "cpu-vec", [3], BS, 0, kv)
    slab = cache[3].reshape(HEADS, 2 * BS * DIM)  # [Hkv, K then V]
    torch.testing.assert_close(slab[:, : BS * DIM].view(HEADS, DIM, BS), kv[0].transpose(1, 2))
    torch.testing.assert_close(slab[:, BS * DIM :].view(HEADS, BS, DIM), kv[1])


def test_split_layout_puts_k_then_v_in_the_last_dimension():
    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)
    kv = torch.randn(2, HEADS, BS, DIM)
    scatter(cache, "split", [1], BS, 0, kv)
    torch.testing.assert_close(cache[1, :, :, :DIM], kv[0])
    torch.testing.assert_close(cache[1, :, :, DIM:], kv[1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_then_gather_round_trips_across_blocks(layout):
    cache = torch.zeros(BLOCKS, HEADS, BS, 2 * DIM)
    block_ids = [5, 0, 2, 4]  # a request's blocks, not in order
    kv = torch.randn(2, HEADS, 11, DIM)  # positions [3, 14): starts and ends mid-block
    scatter(cache, layout, block_ids, BS, 3, kv)
    torch.testing.assert_close(gather(cache, layout, block_ids, BS, 3, 14), kv)
    assert cache[1].abs().sum() == 0 and cache[3].abs().sum() == 0  # other requests' blocks untouched
    assert gather(cache, layout, block_ids, BS, 0, 3).abs().sum() == 0  # positions before start untouched


def test_layer_index_reads_vllm_layer_names():
    assert layer_index("model.layers.17.self_attn.attn") == 17
    with pytest.raises(Exception, match="layer index"):
        layer_index("lm_head")


def test_a_drafts_layers_are_told_from_the_targets() -> None:
    """An EAGLE draft's layers follow the target's 2; a draft model's are under its own prefix (its layer 0
    is not the target's)."""
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "model.layers.2.self_attn.attn",
             "draft_model.model.layers.0.self_attn.attn"]
    assert [draft_layer(name, 2) for name in names] == [False, False, True, True]


def _plan_with_stored(prompt: list[int], stored_chunks: int, chunk: int = 8) -> SchedulerPlan:
    store = MemoryStore()
    salt = tenant_salt("fp", "t")
    for key in chunk_keys(prompt, chunk, salt)[:stored_chunks]:
        store.put(object_name(key, "kv", 0, 2), b"x")

    def lookup(ids, limit, request_salt):
        return cached_prefix_tokens(ids, fingerprint=salted("fp", request_salt), tenant="t", chunk_size=chunk,
                                    stage_layers=[range(2)], store=store, limit=limit)

    return SchedulerPlan(chunk_size=chunk, block_size=4, lookup=lookup, save=True)


def test_a_salted_request_finds_only_its_own_chunks_and_carries_its_salt():
    """A LoRA request's (or cache_salt's) keys are salted: the base chunks are not its, and its load and
    saves say how to key and restore it."""
    prompt = list(range(30))
    plan = _plan_with_stored(prompt, stored_chunks=3)
    lora = Keying(salt="lora:abc", load_only=True)
    assert plan.known_keying("r") is None  # not asked yet: the connector works the keying out
    assert plan.matched("r", prompt, 0, lora) == 0
    assert plan.known_keying("r") == lora  # asked again next step: kept
    load, save = plan.new_request("r", prompt, list(range(8)), computed_after=30)
    assert load is None and save is not None and save.salt == "lora:abc"
    assert plan.matched("b", prompt, 0) == 24  # the base request finds them
    plan.allocated("b", 24)
    load, _ = plan.new_request("b", prompt, list(range(8)), computed_after=30)
    assert load is not None and (load.salt, load.load_only) == ("", False)


def test_plan_loads_the_stored_prefix_and_saves_the_chunks_after_it():
    prompt = list(range(30))  # 3 whole chunks of 8 and a partial one
    plan = _plan_with_stored(prompt, stored_chunks=2)
    assert plan.matched("r", prompt, 4) == 12  # 16 stored; vLLM holds 4 itself
    plan.allocated("r", 12)
    load, save = plan.new_request("r", prompt, [7, 8, 9, 10, 11, 12, 13, 14], computed_after=30)
    assert load is not None and load.start == 4 and load.token_ids == tuple(prompt[:16])
    assert save is not None and save.start == 16 and len(save.token_ids) == 24  # chunk 2 only: 3 is partial


def test_plan_never_matches_the_whole_prompt_and_saves_chunks_as_prefill_advances():
    prompt = list(range(16))
    plan = _plan_with_stored(prompt, stored_chunks=2)
    assert plan.matched("r", prompt, 0) == 8  # the last token is left to vLLM: only chunk 0 counts
    fresh = _plan_with_stored(prompt, stored_chunks=0)
    assert fresh.matched("s", prompt, 0) == 0
    fresh.allocated("s", 0)
    load, save = fresh.new_request("s", prompt, [0, 1], computed_after=10)  # chunked prefill: 10 tokens
    assert load is None and save is not None and (save.start, len(save.token_ids)) == (0, 8)
    load, save = fresh.running_request("s", [2, 3], resumed=False, computed_after=16)
    assert load is None and save is not None and (save.start, len(save.token_ids)) == (8, 16)
    assert save.block_ids == (0, 1, 2, 3)


def test_a_background_load_is_offered_once_and_the_request_then_runs_without_one():
    """The load starts with the next step's metadata; once it ran (and failed, say: vLLM frees the blocks and
    asks again) the request is offered nothing, so a failing load cannot loop; its saves go on after it."""
    prompt = list(range(30))
    plan = _plan_with_stored(prompt, stored_chunks=2)
    assert plan.matched("r", prompt, 0) == 16
    plan.allocated_in_background("r", prompt, [5, 6, 7, 8], 16)
    [background] = plan.take_background_loads()
    assert (background.start, background.token_ids, background.block_ids) == (0, tuple(prompt[:16]), (5, 6, 7, 8))
    assert plan.take_background_loads() == []
    assert plan.matched("r", prompt, 0) == 0  # asked again after a failure: vLLM recomputes
    load, save = plan.new_request("r", prompt, [5, 6, 7, 8, 9, 10, 11, 12], computed_after=30)
    assert load is None and save is not None and save.start == 16
    plan.finished("r")
    assert plan.matched("r", prompt, 0) == 16  # a new request of the same id is looked up afresh


def test_config_refuses_unknown_settings_and_finds_the_tenants_token(tmp_path):
    with pytest.raises(Exception, match="unknown CacheFlow connector settings"):
        ConnectorConfig.from_extra({"pods": ["a:1"], "tenant": "t", "pod_token_file": "f", "chunk": 8},
                                   served_model="m")
    tokens = tmp_path / "tokens"
    tokens.write_text("other x\nt secret\n")
    cfg = ConnectorConfig.from_extra({"pods": "p0=h:1,p1=h:2", "tenant": "t", "pod_token_file": str(tokens)},
                                     served_model="/models/m")
    assert cfg.pods == ("p0=h:1", "p1=h:2") and cfg.model == "/models/m" and cfg.token() == "secret"
