"""The connector on pipeline-parallel vLLM ranks: driven by hand, then (the last test) in vLLM at PP 2.

Two connector worker engines hold ranks [0, L/2) and [L/2, L) of a tiny Qwen3 (separate runtime), over
the same two real storage pods, with paged caches allocated here. The "forward passes" are a reference
prefill of the whole model: its KV is written into each rank's blocks, and rank 1's boundary activation
(the hidden state entering layer L/2) reaches its connector through the pre-hook on a stand-in for vLLM's
model, split into hidden_states + residual as rank 0 would send it, over two chunked-prefill steps with
another request's rows before its own, and padding rows after; the rows are filed by their slots in the
step's slot mapping (a dict stands in for vLLM's forward context, which this venv has no vLLM for; the
last tests read vLLM's own, in vLLM's venv). Fresh engines then restore both ranks at once (threads), each
from its own chunks (rank 1 from its boundary activations); the chunk names are those of a CacheFlow stage split.
The last test runs vLLM itself at pipeline parallel size 2 (with torch.compile: `drive.py` says why).
"""

from __future__ import annotations

import json
import random
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from cacheflow_bench.vllm_compat_cell import fixed_plan
from cacheflow_common.kv.chunk import decode_hidden_chunk, decode_kv_chunk
from cacheflow_common.kv.keys import object_name
from cacheflow_common.model.transformer import Span, Transformer
from cacheflow_common.restore.boundary import boundary_name, save_prefix_by_stage
from cacheflow_common.restore.save import make_job
from cacheflow_common.store.memory import MemoryStore
from cacheflow_services.storage.launch import LocalPod, launch_pod, write_tokens
from cacheflow_services.vllm_connector.both_sides import open_store
from cacheflow_services.vllm_connector.config import ConnectorConfig
from cacheflow_services.vllm_connector.plan import LoadSpec, PromptRows, SaveSpec, SchedulerPlan
from cacheflow_services.vllm_connector.ranks import rank_layers
from cacheflow_services.vllm_connector.worker import WorkerEngine
from tests.vllm.helpers import DRIVE_TIMEOUT_S, REPO, VLLM_PYTHON, drive, save_tiny_qwen3, vllm_env

CHUNK, BS, BLOCKS = 16, 8, 24
LENGTH = 53  # 3 whole chunks (48 tokens) and a partial one
CACHED = LENGTH // CHUNK * CHUNK
BLOCK_IDS = tuple(range(3, 3 + -(-LENGTH // BS)))  # the request's blocks (not from 0)
OTHER_BLOCK_IDS = tuple(range(12, 12 + -(-LENGTH // BS)))  # a second request's, in the same step
KV_TOL = 1e-4  # recomputed KV: fp32-close to the reference prefill
LOGPROB_TOL = 1e-3  # vLLM's greedy logprobs after a restore against its own prefill's


class StandIn(torch.nn.Module):
    """Where vLLM's top-level model sits: its forward takes (input_ids, positions, intermediate_tensors)."""

    def forward(self, input_ids: Any, positions: torch.Tensor, intermediate_tensors: Any = None) -> None:
        return None


class Ranks:
    def __init__(self, root: Path) -> None:
        self.model_dir = root / "tiny-qwen3"
        self.model = save_tiny_qwen3(self.model_dir)
        self.tokens = write_tokens(root / "tokens", ["alpha"])
        self.pods: list[LocalPod] = [launch_pod(root / f"pod{i}", tenants=("alpha",), tokens=self.tokens)
                                     for i in range(2)]
        self.token_file = root / "tokens"
        self.n_layers = self.model.config.num_layers
        self.split = [range(0, self.n_layers // 2), range(self.n_layers // 2, self.n_layers)]

    def cfg(self, **overrides: Any) -> ConnectorConfig:
        return ConnectorConfig(pods=tuple(f"pod-{i}=127.0.0.1:{p.data_port}" for i, p in enumerate(self.pods)),
                               tenant="alpha", pod_token_file=str(self.token_file), chunk_size=CHUNK,
                               model=str(self.model_dir), runtime="cacheflow", share_weights=False,
                               **overrides)

    def engine(self, layers: range, vllm_model: torch.nn.Module | None = None, registered: range | None = None,
               step_slots: dict[str, torch.Tensor] | None = None, **overrides: Any
               ) -> tuple[WorkerEngine, dict[int, torch.Tensor]]:
        """A connector worker engine for the rank holding `layers` (vLLM's split: its runtime loads only
        them), registered with fresh paged caches of `registered` (default: the same; `split` layout)."""
        c = self.model.config
        caches = {i: torch.zeros(BLOCKS, c.num_kv_heads, BS, 2 * c.head_dim) for i in registered or layers}
        engine = WorkerEngine(self.cfg(**overrides), dtype=torch.float32, block_size=BS, device="cpu",
                              layout="split", vllm_model=(lambda: vllm_model), layers=layers,
                              step_slots=None if step_slots is None else step_slots.__getitem__)
        assert engine.model.layers == layers
        engine.register({f"model.layers.{i}.self_attn.attn": cache for i, cache in caches.items()})
        return engine, caches

    def stop(self) -> None:
        for pod in self.pods:
            pod.stop()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory):
    r = Ranks(tmp_path_factory.mktemp("ranks"))
    yield r
    r.stop()


def reference(model: Transformer, prompt: list[int], split: list[range]) -> tuple[torch.Tensor, torch.Tensor]:
    """A full prefill: KV [L, 2, Hkv, N, D] and the hidden state entering split[1].start, [N, hidden]."""
    kv = model.new_kv(range(model.config.num_layers), len(prompt))
    hidden = model.embed(torch.tensor(prompt))  # [N, hidden]
    boundary = model.forward_layers(hidden, split[0], [Span(kv, 0, len(prompt))])  # [N, hidden]
    model.forward_layers(boundary, split[1], [Span(kv, 0, len(prompt))])
    return kv.data[:, :, :, : len(prompt)], boundary


def write_blocks(engine: WorkerEngine, kv: torch.Tensor, start: int, end: int) -> None:
    """What vLLM's forward does to a rank's blocks: positions [start, end) of every layer it holds."""
    from cacheflow_services.vllm_connector.paged import scatter

    for layer, cache in engine.caches:
        scatter(cache, "split", BLOCK_IDS, BS, start, kv[layer, :, :, start:end])


def read_blocks(caches: dict[int, torch.Tensor], end: int, block_ids: tuple[int, ...] = BLOCK_IDS) -> torch.Tensor:
    """A rank's KV of positions [0, end), [layers, 2, Hkv, end, D]."""
    from cacheflow_services.vllm_connector.paged import gather

    return torch.stack([gather(caches[i], "split", block_ids, BS, 0, end) for i in sorted(caches)])


def slots(block_ids: tuple[int, ...], start: int, end: int) -> torch.Tensor:
    """The cache slots of positions [start, end) of a request with these blocks, [end - start]."""
    return torch.tensor([block_ids[p // BS] * BS + p % BS for p in range(start, end)])


def save_on_both_ranks(ranks: Ranks, prompt: list[int], *, capture: bool) -> None:
    """Two chunked-prefill steps (20 then 33 prompt rows) on both ranks, each followed by its saves; rank 1
    gets its boundary rows through the hook on vLLM's model (another request's prompt rows come first in the
    first step's batch, padding rows last) unless `capture` is off."""
    kv, boundary = reference(ranks.model, prompt, ranks.split)
    stand_in = StandIn()
    forward_slots: dict[str, torch.Tensor] = {}  # the slot mappings of the forward running now, by layer
    rank0, _ = ranks.engine(ranks.split[0])
    rank1, _ = ranks.engine(ranks.split[1], vllm_model=stand_in, step_slots=forward_slots)
    assert rank1.capture.attached and not rank0.capture.attached
    other = torch.randn(5, boundary.shape[1])  # [5, hidden]: rows of another request, positions 40-44 of 100
    steps = [(0, 20, SaveSpec("r", tuple(prompt[:16]), BLOCK_IDS, 0)),
             (20, LENGTH, SaveSpec("r", tuple(prompt[:CACHED]), BLOCK_IDS, 16))]
    for start, end, save in steps:
        rows = PromptRows(BS)
        rows.add("r", BLOCK_IDS, start, end, LENGTH)
        if start == 0:
            rows.add("other", OTHER_BLOCK_IDS, 40, 45, 100)
        for engine in (rank0, rank1):
            engine.begin_step(rows)
            write_blocks(engine, kv, start, end)
        if capture:
            stream = torch.cat([other, boundary[start:end]]) if start == 0 else boundary[start:end]
            step_slots = torch.cat([slots(OTHER_BLOCK_IDS, 40, 45), slots(BLOCK_IDS, start, end)]) if start == 0 \
                else slots(BLOCK_IDS, start, end)
            stream = torch.cat([stream, torch.randn(3, stream.shape[1])])  # [R + 3, hidden]: 3 padding rows
            forward_slots[f"model.layers.{ranks.split[1].start}.self_attn.attn"] = \
                torch.cat([step_slots, torch.full((3,), -1)])
            residual = torch.randn_like(stream)  # [R, hidden]: what rank 0 sends is hidden + residual
            positions = torch.zeros(len(stream), dtype=torch.long)  # not read: the slots place the rows
            stand_in(None, positions, intermediate_tensors={"hidden_states": stream - residual, "residual": residual})
        for engine in (rank0, rank1):
            engine.save(save)
    for engine in (rank0, rank1):
        engine.finished(["r", "other"])
        engine.close()


def test_rank_layers_are_the_contiguous_range_vllm_registers():
    assert rank_layers([3, 2, 4], 6) == range(2, 5)
    for bad in ([0, 2], [], [5, 6]):
        with pytest.raises(Exception, match="contiguous range"):
            rank_layers(bad, 6)


def test_both_ranks_save_and_restore_at_once_as_a_stage_split(ranks: Ranks):
    prompt = [random.Random(5).randrange(1024) for _ in range(LENGTH)]
    save_on_both_ranks(ranks, prompt, capture=True)
    kv, boundary = reference(ranks.model, prompt, ranks.split)

    # The objects a CacheFlow stage split (two stage workers, [0, L/2) and [L/2, L)) stores for the prefix.
    job = make_job(ranks.model, prompt[:CACHED], tenant="alpha", chunk_size=CHUNK)
    stage_store = MemoryStore()
    save_prefix_by_stage(ranks.model, job, ranks.split, stage_store)
    store = open_store(ranks.cfg())
    try:
        assert stage_store.names() and all(store.exists(name) for name in stage_store.names())
        for key in job.keys:
            names = [object_name(key, "kv", r.start, r.stop) for r in ranks.split] + [
                boundary_name(key, ranks.split[1].start)]
            assert all(n in stage_store.names() for n in names)
            stored = store.read(names[2])
            assert stored is not None
            _, hidden = decode_hidden_chunk(stored)  # [C, hidden]
            torch.testing.assert_close(hidden, boundary[key.token_start : key.token_end], atol=KV_TOL, rtol=KV_TOL)
            part = store.read(names[1])
            assert part is not None
            trailer, loaded = decode_kv_chunk(part)  # [L/2, 2, Hkv, C, D], exactly the blocks' KV
            assert trailer["layer_start"] == ranks.split[1].start
            assert torch.equal(loaded, kv[ranks.split[1].start :, :, :, key.token_start : key.token_end])
    finally:
        store.close()

    # Fresh ranks restore at once, each its own layers: compute-only (rank 1 entirely from its boundary
    # activations), load-only (exact), and CacheFlow's default policy; one request (the two-pointer
    # executor) or two (the batch engine), in the step or in the background.
    runs = [("compute-only", 1, False), ("load-only", 1, False), ("cacheflow", 1, False), ("compute-only", 2, False),
            ("cacheflow", 2, False), ("cacheflow", 2, True)]
    for policy, n_requests, background in runs:
        engines = [ranks.engine(layers, policy=policy) for layers in ranks.split]
        failed: list[set[int]] = [set(), set()]
        reported: list[list[str]] = [[], []]  # background loads each rank reported
        specs = [LoadSpec("r", tuple(prompt[:CACHED]), BLOCK_IDS, 0),
                 LoadSpec("r2", tuple(prompt[:CACHED]), OTHER_BLOCK_IDS, 0)][:n_requests]

        def load(rank: int, engines: list[Any] = engines, specs: list[LoadSpec] = specs,
                 failed: list[set[int]] = failed, reported: list[list[str]] = reported,
                 background: bool = background) -> None:
            engine = engines[rank][0]
            if not background:
                failed[rank] = engine.load_step(specs)
                return
            engine.start_loads(specs)
            deadline = time.monotonic() + 60
            while len(reported[rank]) < len(specs) and time.monotonic() < deadline:
                done, blocks = engine.finished_loads(set(), idle=True)
                reported[rank] += done
                failed[rank] |= blocks

        threads = [threading.Thread(target=load, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for rank, (engine, caches) in enumerate(engines):
            engine.close()
            assert failed[rank] == set(), (policy, rank, background)
            assert sorted(reported[rank]) == (sorted(spec.req_id for spec in specs) if background else [])
            want = kv[ranks.split[rank].start : ranks.split[rank].stop, :, :, :CACHED]
            for spec in specs:
                got = read_blocks(caches, CACHED, spec.block_ids)
                if policy == "load-only":
                    assert torch.equal(got, want)
                else:
                    torch.testing.assert_close(got, want, atol=KV_TOL, rtol=KV_TOL)


def test_a_rank_without_boundary_activations_fails_its_load_and_vllm_recomputes(ranks: Ranks):
    prompt = [random.Random(6).randrange(1024) for _ in range(LENGTH)]
    save_on_both_ranks(ranks, prompt, capture=False)  # rank 1 stored its KV but no boundary activation
    kv, _ = reference(ranks.model, prompt, ranks.split)
    specs = [LoadSpec("r", tuple(prompt[:CACHED]), BLOCK_IDS, 0),
             LoadSpec("r2", tuple(prompt[:CACHED]), OTHER_BLOCK_IDS, 0)]
    for policy, n_requests in (("compute-only", 1), ("cacheflow", 1), ("cacheflow", 2)):
        rank0, caches0 = ranks.engine(ranks.split[0], policy=policy)
        rank1, caches1 = ranks.engine(ranks.split[1], policy=policy)
        assert rank0.load_step(specs[:n_requests]) == set()  # rank 0 starts from the token embeddings
        blocks = {b for spec in specs[:n_requests] for b in spec.block_ids[: CACHED // BS]}
        assert rank1.load_step(specs[:n_requests]) == blocks  # every block: vLLM recomputes them
        rank0.close()
        rank1.close()
        assert not any(c.abs().sum() for c in caches1.values())  # nothing written, never wrong KV
        for spec in specs[:n_requests]:
            torch.testing.assert_close(read_blocks(caches0, CACHED, spec.block_ids),
                                       kv[ranks.split[0].start : ranks.split[0].stop, :, :, :CACHED],
                                       atol=KV_TOL, rtol=KV_TOL)


def test_prompt_rows_place_a_slot_at_its_request_and_position():
    rows = PromptRows(4)
    rows.add("a", (7, 2, 9), 3, 10, 9)  # positions 3-8 of a prompt of 9 (the 10th row is a decode)
    assert sorted(rows.blocks) == [2, 7, 9]
    assert rows.owner(7 * 4 + 3) == ("a", 3) and rows.owner(2 * 4 + 1) == ("a", 5) and rows.owner(9 * 4) == ("a", 8)
    assert rows.owner(9 * 4 + 1) is None  # position 9: past the prompt
    assert rows.owner(-1) is None and rows.owner(5 * 4) is None  # padding, another request's block
    rows.add("b", (1,), 0, 0, 4)  # no rows this step
    rows.add("c", (3,), 2, 8, 8)  # blocks the scheduler has not handed over yet are left out
    assert 1 not in rows.blocks and rows.blocks[3] == ("c", 0, 8)


def test_the_scheduler_places_a_running_requests_rows_in_the_blocks_it_was_given_over_steps():
    plan = SchedulerPlan(chunk_size=16, block_size=8, lookup=lambda tokens, limit, salt: 0, save=True)
    plan.new_request("r", list(range(30)), [4, 5], computed_after=12)
    first = PromptRows(8)
    plan.add_prompt_rows(first, "r", 0, 12)
    assert first.blocks == {4: ("r", 0, 30), 5: ("r", 8, 30)}
    plan.running_request("r", [11, 6], resumed=False, computed_after=30)
    second = PromptRows(8)
    plan.add_prompt_rows(second, "r", 12, 30)
    plan.add_prompt_rows(second, "unknown", 0, 8)  # never scheduled through the plan: nothing
    assert second.blocks == {5: ("r", 8, 30), 11: ("r", 16, 30), 6: ("r", 24, 30)}


def test_capture_files_rows_by_slot_in_any_batch_order_and_never_fails_the_forward():
    from cacheflow_services.vllm_connector.ranks import BoundaryCapture

    forward_slots: dict[str, torch.Tensor] = {}
    capture, stand_in = BoundaryCapture(forward_slots.__getitem__), StandIn()
    capture.attach(stand_in, "layer")
    hidden = torch.randn(7, 4)  # [R, hidden]: 6 rows and one of padding
    rows = PromptRows(4)
    rows.add("a", (5, 6, 2), 8, 10, 10)
    rows.add("b", (3,), 0, 4, 3)  # b: a prompt of 3, then its first decode row
    forward_slots["layer"] = torch.tensor([13, 14, 15, 2 * 4, 12, 2 * 4 + 1, -1])  # b's rows first, then a's
    capture.begin_step(rows)
    stand_in(None, torch.zeros(7, dtype=torch.long), {"hidden_states": hidden, "residual": None})
    a_rows, b_rows = capture.take("a", 8, 10), capture.take("b", 0, 3)
    assert a_rows is not None and torch.equal(a_rows, hidden[[3, 5]])
    assert b_rows is not None and torch.equal(b_rows, hidden[[4, 0, 1]])
    assert capture.take("b", 0, 4) is None and capture.take("a", 7, 9) is None  # decode rows are not kept
    capture.begin_step(rows)
    forward_slots["layer"] = torch.zeros(3, 1, dtype=torch.long)  # unreadable: nothing kept
    stand_in(None, torch.zeros(3), {"hidden_states": hidden})
    capture.begin_step(rows)
    stand_in(None, torch.tensor([5]), {"residual": hidden})  # no hidden_states: nothing kept, no error
    stand_in(None, torch.tensor([5]), {"hidden_states": hidden})  # no step begun: nothing kept
    capture.release("a", 9)
    assert capture.take("a", 8, 9) is None and capture.take("a", 9, 10) is not None
    capture.finish("b")
    assert capture.take("b", 0, 1) is None
    capture.detach()


def test_rows_kept_past_a_release_no_longer_hold_their_steps_tensor():
    """The rows a request keeps past its stored chunks are its own: the step's [R, hidden] tensor is freed."""
    from cacheflow_services.vllm_connector.ranks import BoundaryCapture

    capture = BoundaryCapture(lambda layer: torch.arange(64))
    rows = PromptRows(16)
    rows.add("a", (0, 1, 2, 3), 0, 64, 70)  # 64 prompt rows of a 70-token prompt in this step
    capture.record(rows, torch.arange(64), torch.randn(64, 8), None)  # [R, hidden]
    whole = capture.take("a", 0, 64)
    capture.release("a", 48)  # three chunks of 16 stored; rows 48..63 wait for the rest of the fourth
    kept = capture.take("a", 48, 64)
    assert whole is not None and kept is not None and torch.equal(kept, whole[48:])
    bases = {row.untyped_storage().data_ptr(): row.untyped_storage().nbytes()
             for row in capture._rows["a"].values()}
    assert list(bases.values()) == [16 * 8 * 4]  # one tensor of the 16 kept rows, not the step's 64


def test_a_rank_refuses_caches_of_other_layers_than_its_split_gives(ranks: Ranks):
    with pytest.raises(Exception, match="not this rank's"):
        ranks.engine(ranks.split[1], registered=range(1, ranks.n_layers))


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")
def test_vllms_own_slot_mapping_places_every_prompt_row_at_its_request_and_position(ranks: Ranks, tmp_path: Path):
    """vLLM's model runner with the connector: chunked prefills of 3 prompts beside decodes, every forward's
    rows placed by the scheduler's metadata and the forward context's slot mapping (rows_probe.py)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(1024) for _ in range(n)] for n in (150, 37, 90)]
    connector = {"pods": [f"pod-0=127.0.0.1:{ranks.pods[0].data_port}"], "tenant": "alpha",
                 "pod_token_file": str(ranks.token_file), "chunk_size": 64}
    spec = {"model": str(ranks.model_dir), "prompts": prompts, "block_size": 32, "connector": connector,
            "out": str(tmp_path)}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with (tmp_path / "probe.log").open("w") as log:
        proc = subprocess.run([str(VLLM_PYTHON), "-P", str(REPO / "tests/vllm/rows_probe.py"),
                               str(tmp_path / "spec.json")], stdout=log, stderr=subprocess.STDOUT, env=vllm_env(),
                              cwd=tmp_path, timeout=DRIVE_TIMEOUT_S)
    assert proc.returncode == 0, (tmp_path / "probe.log").read_text()[-4000:]
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["wrong"] == []
    assert report["placed"] == sum(len(p) for p in prompts)  # every prompt row, once (no prefix cache)
    assert report["forwards"] >= 6 and report["generated"] == [3, 3, 3]  # chunked prefills, then decodes


def _vllm_run(ranks: Ranks, tmp_path: Path, name: str, *, seed: int
              ) -> tuple[Path, list[list[int]], Path, LocalPod, dict[str, Any]]:
    """A vLLM run's pieces: a tiny Qwen3 (`seed`), two prompts (200 and 330 tokens), its stats file, a pod of
    its own (stop it) and the connector's settings over it."""
    model_dir = tmp_path / f"tiny-qwen3-{name}"
    save_tiny_qwen3(model_dir, seed=seed)
    rng = random.Random(seed + 4)
    prompts = [[rng.randrange(1024) for _ in range(n)] for n in (200, 330)]
    stats = tmp_path / f"{name}.jsonl"
    pod = launch_pod(tmp_path / "pod", tenants=("alpha",), tokens=ranks.tokens)
    connector = {"pods": [f"pod-0=127.0.0.1:{pod.data_port}"], "tenant": "alpha",
                 "pod_token_file": str(ranks.token_file), "chunk_size": 64, "stats_file": str(stats)}
    return model_dir, prompts, stats, pod, connector


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")
def test_vllm_pipeline_ranks_restore_with_vllms_own_model(ranks: Ranks, tmp_path: Path):
    """vLLM at pipeline parallel size 2, with the connector over a pod of its own. A first pass prefills and
    stores (rank 1 also its boundary activations); a second restores on both ranks, the front recomputed with
    vLLM's own model (rank 1 from the stored boundary activations) while the back loads; then a fresh vLLM
    process recomputes every chunk on both ranks (compute-only), so its tokens stand on vLLM's model alone.
    Last, with the boundary activations deleted, a third process finds every KV chunk but restores none: the
    scheduler's lookup counts a chunk only with rank 1's boundary activation (rank 1 cannot restore without
    it), so vLLM computes the prompts itself. Every run gives the first pass's tokens, and no rank loads a
    second copy of the weights."""
    model_dir, prompts, stats, pod, connector = _vllm_run(ranks, tmp_path, "pp", seed=7)
    spec = {"model": str(model_dir), "prompts": prompts, "max_tokens": 6, "block_size": 32,
            "pipeline_parallel_size": 2}
    try:
        first = drive({**spec, "connector": connector, "passes": [{"label": "cold"}, {"label": "warm"}]},
                      tmp_path, "pp-split")["results"]
        recomputed = drive({**spec, "connector": {**connector, "policy": "compute-only"},
                            "passes": [{"label": "all"}]}, tmp_path, "pp-recompute")["results"]
        for boundary in (tmp_path / "pod").rglob("*.hidden.*"):
            boundary.unlink()
        unbounded = drive({**spec, "connector": connector, "passes": [{"label": "gone"}]}, tmp_path,
                          "pp-no-boundary")["results"]
    finally:
        pod.stop()
    cold = first[: len(prompts)]
    assert [r["tokens"] for r in unbounded] == [r["tokens"] for r in cold]
    for restored in (first[len(prompts):], recomputed):
        assert [r["tokens"] for r in restored] == [r["tokens"] for r in cold]
        # fp32-close: a wrong rank-1 input (the boundary doubled) moved them by 0.05 with the same tokens
        assert all(abs(a - b) <= LOGPROB_TOL for r, c in zip(restored, cold, strict=True)
                   for a, b in zip(r["logprobs"], c["logprobs"], strict=True))
    events = [json.loads(line) for line in stats.read_text().splitlines()]
    assert {(e["runtime"], e["own_bytes"]) for e in events if e["event"] == "runtime"} == {("vllm", 0)}
    restores = [e for e in events if e["event"] == "restore"]
    assert all(not e["misses"] and e["written"] == e["tokens"] for e in restores)
    assert not [e for e in restores if e["req"].startswith("cold")]  # nothing stored before it
    split = [(0, 2), (2, 4)]  # vLLM's split of the 4 layers
    for layers in split:
        warm = [e for e in restores if e["req"].startswith("warm") and tuple(e["layers"]) == layers]
        everything = [e for e in restores if e["req"].startswith("all") and tuple(e["layers"]) == layers]
        assert sorted(e["tokens"] for e in warm) == sorted(e["tokens"] for e in everything) == [192, 320]
        assert all(e["computed"] > 0 and e["loaded"] > 0 for e in warm)
        assert all(e["computed"] > 0 and e["loaded"] == 0 for e in everything)  # in units of up to 2,048 tokens
        # rank 1 read the boundary activations its fronts start from, rank 0 none
        assert all((e["boundary_bytes_read"] > 0) == (layers[0] > 0) for e in warm + everything)
    assert not [e for e in events if e.get("req", "").startswith("gone") and e["event"] != "save"]


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=".venv-vllm is missing (.ci/run creates it)")
def test_tensor_and_pipeline_parallel_ranks_restore_together(ranks: Ranks, tmp_path: Path):
    """vLLM at TP 2 x PP 2 (four ranks, sharing the host's cores), with a profile, so every rank plans its
    split: the front recomputed with vLLM's model in lockstep with its tensor-parallel peer (the second
    pipeline rank's from its stored boundary activations), the back loaded. The warm pass gives the cold pass's
    tokens, every one of the four ranks restores each prompt with both pointers moving, and none fails."""
    model_dir, prompts, stats, pod, connector = _vllm_run(ranks, tmp_path, "tp-pp", seed=8)
    connector |= fixed_plan(tmp_path / "profile.json")
    spec = {"model": str(model_dir), "prompts": prompts, "max_tokens": 6, "block_size": 32,
            "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "connector": connector,
            "passes": [{"label": "cold"}, {"label": "warm"}]}
    try:
        results = drive(spec, tmp_path, "tp-pp")["results"]
    finally:
        pod.stop()
    cold, warm = results[: len(prompts)], results[len(prompts) :]
    assert [r["tokens"] for r in warm] == [r["tokens"] for r in cold]
    events = [json.loads(line) for line in stats.read_text().splitlines()]
    assert not [e for e in events if e["event"] == "load_error"]
    restores = [e for e in events if e["event"] == "restore" and e["req"].startswith("warm")]
    by_rank: dict[tuple[tuple[int, ...], int], list[dict[str, Any]]] = {}
    for e in restores:
        by_rank.setdefault((tuple(e["layers"]), e["tp_rank"]), []).append(e)
    assert sorted(by_rank) == [((0, 2), 0), ((0, 2), 1), ((2, 4), 0), ((2, 4), 1)]
    for done in by_rank.values():
        assert sorted(e["tokens"] for e in done) == [192, 320]
        assert all(e["computed"] > 0 and e["loaded"] > 0 and not e["misses"] for e in done)
    for tokens in (192, 320):  # the second pipeline rank's pair read its fronts' boundary activations between them
        read = {key: sum(e["boundary_bytes_read"] for e in done if e["tokens"] == tokens)
                for key, done in by_rank.items()}
        assert read[(0, 2), 0] == read[(0, 2), 1] == 0 and read[(2, 4), 0] + read[(2, 4), 1] > 0
