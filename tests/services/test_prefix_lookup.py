"""The coordinator's prefix lookup: the leading run of whole chunks stored for every stage, across the
windows of chunks it looks up at once."""

from __future__ import annotations

import pytest

from cacheflow_common.kv.keys import chunk_keys, object_name, tenant_salt
from cacheflow_common.store.memory import MemoryStore
from cacheflow_common.store.prefix import WINDOW, cached_prefix_tokens

CHUNK, STAGES = 4, (range(0, 2), range(2, 4))
PROMPT = list(range(CHUNK * (2 * WINDOW + 3) + 1))  # 2 windows and 3 chunks whole, then 1 token


def _store(stored: set[tuple[int, int]]) -> MemoryStore:
    """A store holding the (chunk, stage) objects in `stored`."""
    store = MemoryStore()
    for i, key in enumerate(chunk_keys(PROMPT, CHUNK, tenant_salt("fp", "t"))):
        for s, layers in enumerate(STAGES):
            if (i, s) in stored:
                store.put(object_name(key, "kv", layers.start, layers.stop), b"x")
    return store


def _lookup(store: MemoryStore, limit: int = len(PROMPT)) -> int:
    return cached_prefix_tokens(PROMPT, fingerprint="fp", tenant="t", chunk_size=CHUNK, stage_layers=STAGES,
                                store=store, limit=limit)


WHOLE = 2 * WINDOW + 3


@pytest.mark.parametrize("missing, expected_chunks", [
    (set(), WHOLE),  # everything whole is found; the partial last chunk never counts
    ({(0, 0)}, 0),
    ({(WINDOW - 1, 1)}, WINDOW - 1),  # a gap at a window's end
    ({(WINDOW, 0)}, WINDOW),  # ... and at the next one's start
    ({(WINDOW + 5, 1), (WINDOW + 9, 0)}, WINDOW + 5),  # the first gap ends the run
])
def test_the_leading_run_of_chunks_stored_on_every_stage(missing, expected_chunks):
    every = {(i, s) for i in range(WHOLE + 1) for s in range(len(STAGES))}
    assert _lookup(_store(every - missing)) == expected_chunks * CHUNK


def test_the_limit_caps_the_lookup():
    every = {(i, s) for i in range(WHOLE + 1) for s in range(len(STAGES))}
    assert _lookup(_store(every), limit=CHUNK * 3 + 2) == CHUNK * 3


def test_with_boundaries_a_chunk_counts_only_if_each_later_stage_has_its_boundary_activation():
    """What a vLLM pipeline rank needs (it cannot fall back to a pipelined restore as a stage worker does)."""
    from cacheflow_common.restore.boundary import boundary_name

    every = {(i, s) for i in range(WHOLE + 1) for s in range(len(STAGES))}
    store = _store(every)
    keys = chunk_keys(PROMPT, CHUNK, tenant_salt("fp", "t"))
    for key in keys[:5]:  # chunks 0-4 have stage 1's boundary; the rest only their KV
        store.put(boundary_name(key, STAGES[1].start), b"h")

    def lookup(boundaries: bool) -> int:
        return cached_prefix_tokens(PROMPT, fingerprint="fp", tenant="t", chunk_size=CHUNK, stage_layers=STAGES,
                                    store=store, limit=len(PROMPT), boundaries=boundaries)

    assert lookup(False) == WHOLE * CHUNK and lookup(True) == 5 * CHUNK
    single = cached_prefix_tokens(PROMPT, fingerprint="fp", tenant="t", chunk_size=CHUNK, stage_layers=STAGES[:1],
                                  store=store, limit=len(PROMPT), boundaries=True)
    assert single == WHOLE * CHUNK  # one stage: no boundary to look for


def test_with_output_rows_a_chunk_counts_only_if_its_output_rows_are_stored():
    """An EAGLE draft's restore needs each chunk's output rows (an `output` object at the last layer's end); a
    boundary activation there (the residual stream before the final norm) is not them."""
    from cacheflow_common.restore.boundary import OUTPUT_KIND, boundary_name

    store = _store({(i, s) for i in range(WHOLE + 1) for s in range(len(STAGES))})
    keys = chunk_keys(PROMPT, CHUNK, tenant_salt("fp", "t"))
    for key in keys[:3]:
        store.put(boundary_name(key, STAGES[-1].stop, OUTPUT_KIND), b"h")
    store.put(boundary_name(keys[3], STAGES[-1].stop), b"h")

    def lookup(draft_rows: list[tuple[int, str]]) -> int:
        return cached_prefix_tokens(PROMPT, fingerprint="fp", tenant="t", chunk_size=CHUNK, stage_layers=STAGES,
                                    store=store, limit=len(PROMPT), draft_rows=draft_rows)

    assert lookup([(STAGES[-1].stop, OUTPUT_KIND)]) == 3 * CHUNK and lookup([]) == WHOLE * CHUNK


def test_with_an_eagle3_drafts_rows_a_chunk_counts_only_if_each_auxiliary_layers_rows_are_stored():
    """An EAGLE-3 draft's restore needs each chunk's boundary activations entering every auxiliary layer."""
    from cacheflow_common.restore.boundary import BOUNDARY_KIND, boundary_name

    store = _store({(i, s) for i in range(WHOLE + 1) for s in range(len(STAGES))})
    keys = chunk_keys(PROMPT, CHUNK, tenant_salt("fp", "t"))
    aux = [(0, BOUNDARY_KIND), (2, BOUNDARY_KIND)]
    for i, key in enumerate(keys[:4]):
        for layer, kind in aux[: 1 if i == 2 else 2]:  # chunk 2 lacks layer 2's
            store.put(boundary_name(key, layer, kind), b"h")
    found = cached_prefix_tokens(PROMPT, fingerprint="fp", tenant="t", chunk_size=CHUNK, stage_layers=STAGES,
                                 store=store, limit=len(PROMPT), draft_rows=aux)
    assert found == 2 * CHUNK
