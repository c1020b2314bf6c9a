"""Restores with a meeting point planned before they start (tensor-parallel ranks, LoRA): the split a rank plans
from the chunks, the costs (the profile's, scaled by what it measured) and the policy, the latest of the ranks'
taken by all; the back's loads into a request's blocks up to the first miss, each chunk timed, the rows a draft
reads loaded with it. The front's forwards need vLLM's model: `test_step_aside.py` runs them on two
tensor-parallel vLLM ranks."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import cast

import pytest
import torch

from cacheflow_common.kv.keys import object_name
from cacheflow_common.restore.boundary import (
    OUTPUT_KIND,
    BoundaryInput,
    BoundaryMissingError,
    boundary_name,
    save_boundaries,
    save_prefix_by_stage,
    stage_jobs,
)
from cacheflow_common.restore.loader import KVLoader, staging_buffer
from cacheflow_common.restore.save import make_job, save_prefix
from cacheflow_common.sched.policies import POLICIES
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.shaped import ShapedStore
from cacheflow_common.transport.shaping import TokenBucket
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.paged import LAYOUTS, gather
from cacheflow_services.vllm_connector.planned_fronts import Fronts, front_forwards, front_inputs
from cacheflow_services.vllm_connector.planned_split import (
    SplitPlan,
    chunk_load_times,
    latest_fronts,
    planned_front,
    restore_split,
)
from cacheflow_services.vllm_connector.ranks import RowShare
from cacheflow_services.vllm_connector.saves import ConnectorSaves
from cacheflow_services.vllm_connector.vllm_runtime import VllmRuntime
from tests.factories import TINY_COSTS, CountingStore, tiny_model

CHUNK, BS = 16, 8
KV_BYTES = 256  # one token's KV in one layer


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _job(model, n_tokens: int):
    return make_job(model, [i % model.config.vocab_size for i in range(n_tokens)], tenant="t", chunk_size=CHUNK)


def _front(job, policy: str, *, start: int = 0, costs=TINY_COSTS, kv_bytes: int = KV_BYTES) -> int:
    load_s = chunk_load_times(job, costs, kv_bytes) if costs is not None else []
    return planned_front(job, start=start, costs=costs, policy=POLICIES[policy], load_s=load_s)


def test_the_front_is_the_split_that_ends_first_or_what_the_policy_fixes(model):
    job = _job(model, 8 * CHUNK)
    planned = _front(job, "cacheflow")
    assert 0 < planned < 8 * CHUNK and planned % CHUNK == 0  # some chunks each side at these costs
    assert _front(job, "cake") == planned
    assert _front(job, "cacheflow", costs=None) == 0  # no profile
    assert _front(job, "load-only") == 0
    assert _front(job, "compute-only") == 8 * CHUNK
    slow_loads = _front(job, "cacheflow", kv_bytes=100 * KV_BYTES)
    assert slow_loads > planned  # dearer loads: more recomputed
    held = _front(job, "compute-only", start=3 * CHUNK + BS)
    assert held == 8 * CHUNK  # vLLM holds a prefix: the split is over the chunks from it on
    assert _front(job, "cacheflow", start=8 * CHUNK) == 8 * CHUNK


def test_ranks_take_the_latest_front_any_of_them_planned(model):
    job = _job(model, 8 * CHUNK)
    kv = _blocks(model, 8 * CHUNK, 0)[0]
    mine: list[SplitPlan | BaseException] = [SplitPlan(job, kv, 0, 2 * CHUNK), ValueError("no plan"),
                                             SplitPlan(job, kv, CHUNK, 5 * CHUNK)]
    others = [-4 * CHUNK, -3 * CHUNK, -CHUNK]  # the other rank's fronts, negated (a MIN over the ranks)
    agreed = latest_fronts(mine, lambda values: [min(a, b) for a, b in zip(values, others, strict=True)])
    assert [plan.front if isinstance(plan, SplitPlan) else plan for plan in agreed] == [4 * CHUNK, mine[1], 5 * CHUNK]


def test_each_loaded_chunk_is_timed_and_set_against_its_prediction(model):
    n, rate = 6 * CHUNK, 2e6  # bytes per second: each chunk's read takes a few milliseconds
    job, raw = _job(model, n), MemoryStore()
    save_prefix(model, job, raw)
    raw.delete(object_name(job.keys[4], "kv", 0, model.config.num_layers))
    store = ShapedStore(raw, TokenBucket(rate, burst_bytes=0))
    predicted = [0.001 * (unit + 1) for unit in range(len(job.keys))]
    done = restore_split(job, store, _blocks(model, n, CHUNK)[0], None, start=CHUNK, front=CHUNK,
                         prefill_tokens=2048, load_s=predicted)
    assert (done.loaded, done.miss) == (3, "absent")  # chunks 1, 2, 3
    assert [p for p, _ in done.timed] == predicted[1:4] and all(measured > 0 for _, measured in done.timed)
    assert done.predicted_load_s == pytest.approx(sum(predicted[1:4]))
    assert done.load_s >= done.bytes_read / rate * 0.99  # no sooner than the link lets them land
    unpredicted = restore_split(job, store, _blocks(model, n, CHUNK)[0], None, start=CHUNK, front=CHUNK,
                                prefill_tokens=2048)
    assert unpredicted.predicted_load_s == 0.0 and unpredicted.load_s > 0


def test_the_rows_a_draft_reads_are_loaded_with_each_chunk_and_counted_in_its_predicted_time(model):
    n, layers = 6 * CHUNK, model.config.num_layers
    job, store = _job(model, n), MemoryStore()
    save_prefix(model, job, store)
    rows = torch.randn(n, model.config.hidden_size)  # [N, hidden]: the model's output rows, as an EAGLE draft reads
    output = dataclasses.replace(job, layers=range(layers, layers + 1))
    save_boundaries(output, rows, store, model_fingerprint="fp", keys=job.keys[1:3], kind=OUTPUT_KIND)  # chunks 1, 2
    kv = _blocks(model, n, CHUNK)[0]
    kv.keep_outputs()
    done = restore_split(job, store, kv, None, start=CHUNK, front=CHUNK, prefill_tokens=2048,
                         draft_sources=[(layers, OUTPUT_KIND)])
    assert (done.end, done.loaded) == (n, 5)  # chunk 3 without its rows still loads: the draft stops there
    for key in job.keys[1:3]:
        store.delete(boundary_name(key, layers, OUTPUT_KIND))
    kept = kv.outputs(CHUNK, 3 * CHUNK)
    assert kept is not None and torch.equal(kept, rows[CHUNK : 3 * CHUNK])  # kept with the KV, read with it
    assert kv.outputs(3 * CHUNK, 4 * CHUNK) is None
    with_rows = chunk_load_times(job, TINY_COSTS, KV_BYTES, row_bytes=4 * model.config.hidden_size)
    assert all(a > b for a, b in zip(with_rows, chunk_load_times(job, TINY_COSTS, KV_BYTES), strict=True))


def _blocks(model, n_tokens: int, start: int, layout: str = "split", fill: float = 0.0
            ) -> tuple[BlockKV, dict[int, torch.Tensor]]:
    c = model.config
    caches = {i: torch.full((n_tokens // BS + 2, c.num_kv_heads, BS, 2 * c.head_dim), fill)
              for i in range(c.num_layers)}
    kv = BlockKV(layers=range(c.num_layers), num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, capacity=n_tokens,
                 dtype=torch.float32, caches=caches, layout=layout, block_ids=tuple(range(1, n_tokens // BS + 1)),
                 block_size=BS, first_writable=start)
    return kv, caches


def _in_blocks(caches: dict[int, torch.Tensor], layout: str, n_tokens: int) -> torch.Tensor:
    """[L, 2, Hkv, N, D]: what the request's blocks hold."""
    block_ids = tuple(range(1, n_tokens // BS + 1))
    return torch.stack([gather(caches[i], layout, block_ids, BS, 0, n_tokens) for i in sorted(caches)])


@pytest.mark.parametrize("seed", range(20))
def test_fronts_started_together_share_forwards_each_front_once_in_order(seed):
    """Restores started in one step: every front's positions recomputed once, in order, each forward within the
    budget and holding at most one slice of a front; as few forwards as the tokens need."""
    rng = torch.Generator().manual_seed(seed)
    budget = int(torch.randint(64, 600, (1,), generator=rng))
    starts = torch.randint(0, 300, (int(torch.randint(1, 6, (1,), generator=rng)),), generator=rng).tolist()
    fronts = [(a, a + int(torch.randint(0, 900, (1,), generator=rng))) for a in starts]
    forwards = front_forwards(fronts, budget)
    total = sum(end - start for start, end in fronts)
    assert len(forwards) == -(-total // budget)
    at = [start for start, _ in fronts]
    for forward in forwards:
        assert 0 < sum(b - a for _, a, b in forward) <= budget
        assert len({i for i, _, _ in forward}) == len(forward)
        for i, a, b in forward:
            assert a == at[i] < b <= fronts[i][1]
            at[i] = b
    assert at == [end for _, end in fronts]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loaded_chunks_go_straight_into_the_blocks_and_never_before_vllms_own_prefix(model, layout):
    """No buffer of the restore's own: each loaded chunk is written into the blocks as it lands (in every cache
    layout), from the first position vLLM does not hold (here mid-chunk) on; vLLM's own positions keep theirs."""
    n, start = 4 * CHUNK, CHUNK + 3
    job, store = _job(model, n), MemoryStore()
    reference = save_prefix(model, job, store).data  # [L, 2, Hkv, N, D]
    kv, caches = _blocks(model, n, start=start, layout=layout, fill=-7.0)
    assert kv.data.numel() == 0
    done = restore_split(job, store, kv, None, start=start, front=start, prefill_tokens=2048)
    assert (done.end, done.loaded, done.miss) == (n, 3, "")
    got = _in_blocks(caches, layout, n)
    assert torch.equal(got[:, :, :, start:], reference[:, :, :, start:])  # exact
    assert (got[:, :, :, :start] == -7.0).all()


def test_a_sealed_restore_writes_nothing_into_the_blocks(model):
    """Once the connector has told vLLM a load is over, vLLM may give the blocks to another request: a load
    still in flight then must not land there."""
    n = 2 * CHUNK
    job, store = _job(model, n), MemoryStore()
    save_prefix(model, job, store)
    kv, caches = _blocks(model, n, start=0)
    kv.seal()
    restore_split(job, store, kv, None, start=0, front=0, prefill_tokens=2048)
    assert not any(cache.any() for cache in caches.values())


def test_the_back_loads_into_the_blocks_up_to_the_first_miss(model):
    n = 6 * CHUNK
    job, store = _job(model, n), MemoryStore()
    reference = save_prefix(model, job, store).data  # [L, 2, Hkv, N, D]
    store.delete(object_name(job.keys[4], "kv", 0, model.config.num_layers))
    kv, caches = _blocks(model, n, start=CHUNK)
    done = restore_split(job, store, kv, None, start=CHUNK, front=CHUNK, prefill_tokens=2048)
    assert (done.end, done.computed, done.loaded, done.miss) == (4 * CHUNK, 0, 3, "absent")
    got = _in_blocks(caches, "split", n)
    assert torch.equal(got[:, :, :, CHUNK : 4 * CHUNK], reference[:, :, :, CHUNK : 4 * CHUNK])  # exact
    assert not got[:, :, :, :CHUNK].any() and not got[:, :, :, 4 * CHUNK :].any()  # vLLM's, and vLLM recomputes
    with pytest.raises(RuntimeError, match="vLLM's model"):
        restore_split(job, store, _blocks(model, n, 0)[0], None, start=0, front=CHUNK, prefill_tokens=2048)


def test_chunks_recomputed_into_the_blocks_are_stored_from_there(model):
    """After a miss the restore recomputes a chunk into the blocks; the connector stores it again from them,
    and a later restore loads exactly what the blocks held."""
    n = 3 * CHUNK
    job, first = _job(model, n), MemoryStore()
    reference = save_prefix(model, job, first).data  # [L, 2, Hkv, N, D]
    kv, _ = _blocks(model, n, start=0, layout="cpu-vec")
    restore_split(job, first, kv, None, start=0, front=0, prefill_tokens=2048)  # the blocks hold the prefix
    again, events = MemoryStore(), []
    saves = ConnectorSaves(again, lambda kind, **fields: events.append(kind), fingerprint=model.fingerprint(),
                           dtype=torch.float32, kv_dtype="float32", chunk_size=CHUNK, tenant="t")
    saves.store_again("r", [(job.keys[1], kv.gather(CHUNK, 2 * CHUNK))], job, salt="")
    saves.close()
    assert not events  # no save_error
    loaded = model.new_kv(job.layers, n)
    loader = KVLoader(store=again, keys=job.keys, layers=job.layers, kv=loaded, dtype=job.kv_dtype, quant=job.quant)
    assert (loader.load_chunk(0), loader.load_chunk(1)) == ("absent", "")
    assert torch.equal(loaded.data[:, :, :, CHUNK : 2 * CHUNK], reference[:, :, :, CHUNK : 2 * CHUNK])


class MeetingStore(MemoryStore):
    """The first reads wait until `parties` of them are in flight at once (or time out: then the test fails)."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self._barrier = threading.Barrier(parties, timeout=10)
        self._met = threading.Event()

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        if not self._met.is_set():
            self._barrier.wait()
            self._met.set()
        return super().readv_into(name, views, offset)


@pytest.mark.parametrize(("quant", "unit"), [("none", "chunk"), ("int8", "chunk"), ("none", "layer")])
def test_readers_land_units_of_one_request_in_its_blocks_at_once(model, quant, unit):
    """Each reader (a channel) lands its unit in a host area of its own before it goes into the blocks, so two
    readers of one request never wait for each other (the store lets no read through until both read), and
    what reaches the blocks is what a CPU buffer of the restore's own would hold (int8: dequantized alike)."""
    n = 4 * CHUNK
    job, store = make_job(model, [i % model.config.vocab_size for i in range(n)], tenant="t", chunk_size=CHUNK,
                          quant=quant), MeetingStore(parties=2)
    save_prefix(model, job, store)
    own = model.new_kv(job.layers, n)  # the reference: a CPU buffer, loaded in place
    plain = KVLoader(store=store, keys=job.keys, layers=job.layers, kv=own, dtype=job.kv_dtype, quant=quant)
    kv, caches = _blocks(model, n, start=0)
    loader = KVLoader(store=store, keys=job.keys, layers=job.layers, kv=kv, dtype=job.kv_dtype, quant=quant)
    load = loader.load_chunk if unit == "chunk" else loader.load_layer
    units = range(len(job.keys)) if unit == "chunk" else job.layers
    reasons: list[str] = []

    def reader(mine: range) -> None:
        staging = staging_buffer(loader.staging_bytes)
        reasons.extend(load(u, staging) for u in mine)

    threads = [threading.Thread(target=reader, args=(units[i::2],)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reasons == [""] * len(units)
    assert all(not (plain.load_chunk(i) if unit == "chunk" else plain.load_layer(i)) for i in units)
    assert torch.equal(_in_blocks(caches, "split", n), own.data)


class _ModelSide:
    """What a front's inputs ask of vLLM's model: the device and dtype of its rows, its width, and its embedding
    (here CacheFlow's tiny model's; the forwards themselves run on vLLM's ranks in `test_step_aside.py`)."""

    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self, model) -> None:
        self.model = model
        self.config = model.config

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(ids)


class _Ranks:
    """`agree` on one rank of a tensor-parallel group: records this rank's answer, and holds only if the other
    ranks' (`others`) hold too."""

    def __init__(self, others: bool = True) -> None:
        self.others = others
        self.asked: list[bool] = []

    def __call__(self, ok: bool) -> bool:
        self.asked.append(ok)
        return ok and self.others


def _side(model) -> VllmRuntime:
    return cast(VllmRuntime, _ModelSide(model))


def _stage_plans(model, store, n: int, start: int, front: int) -> list[SplitPlan]:
    """A prefix stored by two stages (the second's boundary activations too): one plan per stage."""
    job = _job(model, n)
    half = model.config.num_layers // 2
    save_prefix_by_stage(model, job, [range(0, half), range(half, model.config.num_layers)], store)
    return [SplitPlan(stage, _blocks(model, n, start)[0], start, front)
            for stage in stage_jobs(job, [range(0, half), range(half, model.config.num_layers)])]


def test_a_later_pipeline_ranks_front_starts_from_its_stored_boundary_activations(model):
    """The first rank's front starts from the tokens' embeddings, a later rank's from the boundary activations
    stored for it (a front starting inside a chunk included), read before any forward: the ranks of a stage
    agree they all read them (once, for the step)."""
    store, n, start, front = MemoryStore(), 6 * CHUNK, CHUNK + BS, 4 * CHUNK
    first, later = _stage_plans(model, store, n, start, front)
    ranks = _Ranks()
    from_embeddings, from_boundaries = front_inputs([first, later], store, _side(model), ranks)
    assert ranks.asked == [True] and from_embeddings is not None and from_boundaries is not None
    ids = torch.tensor(first.job.token_ids, dtype=torch.long)
    assert torch.equal(from_embeddings(start, front), model.embed(ids[start:front]))
    with BoundaryInput(later.job, store, prefetch=0) as boundary:
        stored = boundary(0, n)  # [N, hidden]
    assert torch.equal(from_boundaries(start, 3 * CHUNK), stored[start : 3 * CHUNK])
    assert torch.equal(from_boundaries(3 * CHUNK, front), stored[3 * CHUNK : front])
    assert front_inputs([first], store, _side(model), ranks)[0] is not None
    assert ranks.asked == [True]  # no boundary read, no collective
    assert front_inputs([later._replace(front=start)], store, _side(model), _Ranks(others=False)) == [None]


def test_a_boundary_any_rank_cannot_read_fails_the_steps_restores_on_every_rank(model):
    """A missing boundary activation fails the step's planned restores before any forward, and a rank that read
    all of its own fails them too when another could not (`agree` is the ranks' collective)."""
    store, n = MemoryStore(), 6 * CHUNK
    first, later = _stage_plans(model, store, n, 0, 3 * CHUNK)
    failing_other, ranks = _Ranks(others=False), _Ranks()
    with pytest.raises(BoundaryMissingError, match="another tensor-parallel rank"):
        front_inputs([later], store, _side(model), failing_other)
    store.delete(boundary_name(later.job.keys[1], later.job.layers.start))
    with pytest.raises(BoundaryMissingError, match="not in the store"):
        front_inputs([first, later], store, _side(model), ranks)
    assert (failing_other.asked, ranks.asked) == ([True], [False])  # once each, with this rank's own answer
    unreachable = _Ranks()
    with pytest.raises(ConnectionError):
        front_inputs([later], _Unreachable(), _side(model), unreachable)
    assert unreachable.asked == [False]  # a read that raised still answers the other ranks


@dataclasses.dataclass(frozen=True)
class _RankOfTwo(RowShare):
    """One of two tensor-parallel ranks whose `gather` records the rows this rank adds and returns `total` (what
    the real collective returns: the ranks' rows added up; `test_row_share.py` runs it over a real group)."""

    sent: list[torch.Tensor] = dataclasses.field(default_factory=list)
    total: torch.Tensor | None = None

    def gather(self, rows: torch.Tensor, group: object = None) -> torch.Tensor:
        self.sent.append(rows.clone())
        return rows if self.total is None else self.total


def test_a_later_pipeline_ranks_tensor_parallel_ranks_each_read_every_other_chunks_boundary_and_add_them_up(model):
    """Two tensor-parallel ranks of a later pipeline rank read the boundary activations of alternate chunks (by
    chunk index, as they saved them), zeros for the other's; one gather for the step's plans adds them up into
    every chunk's, and a rank that lacks one of its own chunks fails the step on both (no gather)."""
    store, n = CountingStore(), 6 * CHUNK
    later = _stage_plans(model, store, n, CHUNK + BS, 5 * CHUNK)[1]
    other = later._replace(start=0, front=2 * CHUNK)  # a second restore started in the same step
    with BoundaryInput(later.job, store, prefetch=0) as boundary:
        stored = boundary(0, n)  # [N, hidden]
    size = {key.index: len(MemoryStore.read(store, boundary_name(key, later.job.layers.start)) or b"")
            for key in later.job.keys}  # each chunk's stored boundary activation (not counted as a read)
    ranks = [_RankOfTwo(rank, 2) for rank in range(2)]
    for rank in ranks:
        store.reads.clear()
        inputs = front_inputs([later, other], store, _side(model), _Ranks(), rank)
        mine = [boundary_name(key, later.job.layers.start) for chunks in (range(1, 5), range(2)) for key in
                later.job.keys if key.index in chunks and key.index % 2 == rank.rank]  # its chunks of each front
        assert sorted(store.reads) == sorted(mine)
        read = Fronts([later, other], inputs, None, prefill_tokens=2048, step_tokens=None).boundary_bytes_read
        assert read == [sum(size[c] for c in chunks if c % 2 == rank.rank) for chunks in (range(1, 5), range(2))]
    [sent0], [sent1] = ranks[0].sent, ranks[1].sent
    expected = torch.cat([stored[CHUNK : 5 * CHUNK], stored[: 2 * CHUNK]])  # each from the chunk holding its start
    assert sent0.shape == expected.shape and torch.equal(sent0 + sent1, expected)  # disjoint chunks
    assert torch.equal(sent0[:CHUNK], torch.zeros(CHUNK, stored.shape[1]))  # chunk 1 is rank 1's
    summed = _RankOfTwo(0, 2, total=sent0 + sent1)
    from_later, from_other = front_inputs([later, other], store, _side(model), _Ranks(), summed)
    assert from_later is not None and from_other is not None
    assert torch.equal(from_later(CHUNK + BS, 5 * CHUNK), stored[CHUNK + BS : 5 * CHUNK])
    assert torch.equal(from_other(0, 2 * CHUNK), stored[: 2 * CHUNK])
    store.delete(boundary_name(later.job.keys[3], later.job.layers.start))  # rank 1's
    fine, lacking = _RankOfTwo(0, 2), _RankOfTwo(1, 2)
    with pytest.raises(BoundaryMissingError, match="another tensor-parallel rank"):
        front_inputs([later], store, _side(model), _Ranks(others=False), fine)
    with pytest.raises(BoundaryMissingError, match="not in the store"):
        front_inputs([later], store, _side(model), _Ranks(), lacking)
    assert fine.sent == lacking.sent == []


class _Unreachable(MemoryStore):
    """A store whose pod cannot be reached: every read raises."""

    def read(self, name: str) -> bytes | None:
        raise ConnectionError(f"{name}: connection refused")
