"""Restoring a speculative draft's KV with the target's: vLLM's draft layers rerun over the restored positions
that no stored draft KV covers (the draft's KV stored with the chunks is loaded first: draft_kv.py).

With `--speculative-config '{"method": "eagle", ...}'` vLLM keeps a KV cache for the draft's own layers
(`model.layers.<L>...`, after the target's L), in the same blocks as the target's. When vLLM computes a prompt
chunk [s, e), its drafter runs once over the same positions: at position i its input is the next token
(token i + 1; at e - 1 the prompt's token e, or the sampled one) and the target's row at i, and its layers
write their KV at i. The row is, for EAGLE, the target's output (the last layer's hidden state after the final
norm: what enters the LM head); for EAGLE-3, the residual streams entering the target's auxiliary layers
(vLLM's model returns them beside its output), side by side, which the draft first combines
(`combine_hidden_states`).

A restore gives the target's KV for [start, N) without running vLLM's step over them. Where the draft's own KV
of those positions was not stored (by an instance with `draft_kv` off, or the chunk that ended its prompt: its
next token was sampled), the connector runs the drafter's first pass over them itself, as vLLM would have
(`DraftPass`), from where the loaded draft KV ends (`restore_drafts`): its inputs are the prompt's
tokens [start + 1, N] (token N is the one after the prefix, `LoadSpec.next_token`) and the target's output
rows — for positions vLLM's model recomputed, those it returned (`BlockKV.keep_outputs`); for loaded chunks,
the rows stored with them, which the saving side captures from vLLM's own forward (a forward hook on its model,
`ranks.BoundaryCapture`): EAGLE's as `output` objects at layer L (`boundary.OUTPUT_KIND`), EAGLE-3's as the
boundary activations entering each auxiliary layer (the objects a pipeline rank starting there restores from).

A chunk stored without its rows (by an instance without the draft) cannot give the draft its KV: the restore
ends before it, and vLLM computes the rest (target and draft); the scheduler's lookup does not count such a chunk
at all (`support.draft_sources`: EAGLE-3's layers as vLLM's config names them). Draft KV is a function of the
tokens and the target's rows, so a restored draft drafts exactly what it would have after vLLM's own prefill;
its drafts never change the output (the target verifies them), only how many are accepted.

Under tensor parallelism the draft's layers are split like the target's, so every rank runs the same draft
forwards, in lockstep: the ranks agree on how far each restore's draft goes (the least any rank reached:
`restore_drafts`) before any of them runs it. The rows are not split by head: every rank's draft reads all of
them. So the ranks share them (`ranks.RowShare`): each stores and reads those of every TP-th chunk, and before
the rerun the ranks add up what they read over vLLM's tensor-parallel group, as bytes (exact: each byte is one
rank's), so each moves 1/TP of the rows instead of all of them (the chunks' predicted load times count 1/TP).
A restore in the background (`planned_loads.py`) reruns its draft once its loads ended on every rank (each
rank's end when they do: the ranks agree on that first).

An MTP draft (`"method": "mtp"`: the model's own multi-token-prediction layers, e.g. MiMo's, GLM-4.5's) is fed
by vLLM's EAGLE proposer the same way: the next token and the target's output row at each position, its layers
(`model.layers.<L>...`) writing KV of their own. It is restored as an EAGLE draft is (MTP layers that vLLM feeds
with proposers of their own make the connector step aside: `support.py`).

Under LoRA, vLLM applies a request's adapter to the target alone: its draft runs with the base weights over the
adapted target's rows (stored under the adapter's keys, or returned by the recompute under it). The rerun's
forwards set the same LoRA mapping as the recompute's (`VllmRuntime.forward_context`), so a draft that shares the
target's LoRA-wrapped embedding reads it as in vLLM's step.

A draft model (`"method": "draft_model"`: a smaller model of the target's vocabulary, under the prefix
`draft_model.`) reads the tokens alone: vLLM's drafter runs it over the target's tokens at their own
positions (not shifted), so its rerun needs no rows, and a chunk of any instance can give it its KV. Its rerun
is a prefill of the draft model over the restored positions: the draft's share of a full prefill.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from cacheflow_common.kv.keys import ChunkKey
from cacheflow_common.model.transformer import Span
from cacheflow_common.restore.boundary import BoundaryInput, BoundaryMissingError
from cacheflow_common.restore.job import RestoreJob
from cacheflow_services.vllm_connector.block_kv import BlockKV
from cacheflow_services.vllm_connector.plan import LoadSpec
from cacheflow_services.vllm_connector.ranks import ONE_RANK, RowShare
from cacheflow_services.vllm_connector.vllm_runtime import VllmRuntime, forward_groups


class DraftPass:
    def __init__(self, runtime: VllmRuntime, drafter: Any, *, sources: Sequence[tuple[int, str]],
                 combine: bool = False) -> None:
        """`drafter`: vLLM's loaded draft model (its runner's `drafter.model`); `sources`: the stored rows it
        reads, side by side, each (layer, kind): the output rows at the target's layer count (EAGLE, MTP), the
        boundary activations at its auxiliary layers (EAGLE-3); none: a draft model, which reads the tokens
        alone; `combine`: the draft first combines them (EAGLE-3's `combine_hidden_states`, as vLLM's proposer
        calls it)."""
        self.runtime = runtime
        self.drafter = drafter
        self.sources = tuple(sources)
        self.combine = combine

    def rows(self, spec: LoadSpec, job: RestoreJob, kv: BlockKV, store: Any, end: int,
             share: RowShare = ONE_RANK) -> tuple[torch.Tensor, int]:
        """The draft's input rows for positions [spec.start, end'), [end' - start, k * hidden] (the `sources` side by
        side), and end' (<= end): the rows vLLM's model returned, else those stored with the chunk, up to the
        first chunk with neither. A draft model reads no rows: [0, 0], and end. Under tensor parallelism only the
        chunks `share` gives this rank, zeros elsewhere (`RowShare.gather` adds the ranks' up)."""
        if not self.sources:
            return torch.empty(0, 0), end
        parts, reached = [], spec.start
        for key in job.keys:
            if key.token_end <= spec.start or key.token_start >= end:
                continue
            first, last = max(key.token_start, spec.start), min(key.token_end, end)
            if not share.mine(key.index):  # another rank's: it reads them, or stops the draft where it cannot
                width = len(self.sources) * self.runtime.config.hidden_size  # a row's: its sources side by side
                parts.append(torch.zeros(last - first, width, dtype=self.runtime.dtype, device=self.runtime.device))
                reached = last
                continue
            rows = kv.outputs(first, last)
            if rows is None:
                try:
                    rows, n_bytes = stored_rows(job, store, self.sources, key)
                except BoundaryMissingError:
                    break
                kv.read_draft_rows(n_bytes)
                rows = rows[first - key.token_start : last - key.token_start]  # [T, k * hidden]
            parts.append(rows.to(self.runtime.device, self.runtime.dtype))
            reached = last
        hidden = torch.cat(parts) if parts else torch.empty(0, 0)
        return hidden, reached

    @torch.inference_mode()
    def run(self, spec: LoadSpec, kv: BlockKV, rows: torch.Tensor, end: int) -> None:
        """The drafter's first pass over positions [spec.start, end), writing its KV into the request's blocks:
        rows [end - start, k * hidden] its input rows there (`rows`; an EAGLE draft's)."""
        if end <= spec.start:
            return
        # an EAGLE draft at position i reads token i + 1, a draft model token i
        tokens = (*spec.token_ids[spec.start + 1 : end], *_next(spec, end)) if self.sources \
            else spec.token_ids[spec.start : end]
        ids = torch.tensor(tokens, dtype=torch.long, device=self.runtime.device)  # [end - start]
        if self.combine:
            rows = self.drafter.combine_hidden_states(rows)  # [end - start, k * hidden] -> [end - start, hidden]
        for group in forward_groups([Span(kv, spec.start, end - spec.start)], self.runtime.max_rows):
            self._forward(group, ids, rows)

    def _forward(self, spans: Sequence[Span], ids: torch.Tensor, rows: torch.Tensor) -> None:
        """One drafter forward over `spans` (pieces of one request's run, rows from `spans[0].row`)."""
        first, last = spans[0].row, spans[-1].row + spans[-1].length
        rows_in = {"hidden_states": rows[first:last]} if self.sources else {}  # a draft model reads none
        with self.runtime.forward_context(spans) as positions:
            self.drafter(input_ids=ids[first:last], positions=positions, inputs_embeds=None, **rows_in)


@dataclass
class Restored:
    """One restore whose draft is to be rerun: what it wrote into `kv`'s blocks ends at `end` (`job` and `kv`
    None: the restore failed, no draft is rerun)."""

    spec: LoadSpec
    job: RestoreJob | None
    kv: BlockKV | None
    end: int


StoredDraft = Callable[[Restored], tuple[int, int]]  # a restore -> where its stored draft KV loaded ends, bytes


def stored_rows(job: RestoreJob, store: Any, sources: Sequence[tuple[int, str]],
                key: ChunkKey) -> tuple[torch.Tensor, int]:
    """The rows a draft reads at chunk `key`, as stored with it: [C, k * hidden], its `sources` side by side
    (see `DraftPass`), and the bytes read for them. BoundaryMissingError where one is missing or wrong."""
    reads = [BoundaryInput(replace(job, layers=range(layer, layer + 1)), store, prefetch=0, kind=kind)
             for layer, kind in sources]
    rows = torch.cat([read(key.token_start, key.token_end) for read in reads], dim=-1)  # [C, k * hidden]
    return rows, sum(read.bytes_read for read in reads)


def keep_draft_rows(job: RestoreJob, kv: BlockKV, store: Any, sources: Sequence[tuple[int, str]],
                    share: RowShare = ONE_RANK) -> Callable[[int], None]:
    """What to do after each chunk a restore loads (called with its index, on the loading thread): read the rows
    its draft reads there (`sources`; none: nothing; under tensor parallelism the chunks `share` gives this rank)
    and keep them with the restore's KV, where the draft's rerun finds them (`DraftPass.rows`) instead of reading
    them one by one after the loads. A chunk without them is left for the rerun, which stops there."""
    def keep(unit: int) -> None:
        key = job.keys[unit]
        if not share.mine(key.index):
            return
        try:
            rows, n_bytes = stored_rows(job, store, sources, key)  # [C, k * hidden]
        except Exception:  # missing, wrong, its pod unreachable: the rerun reads it again and stops there
            return
        kv.read_draft_rows(n_bytes)
        kv.keep(key.token_start, rows)

    return keep if sources else lambda unit: None


def restore_drafts(restored: Sequence[Restored], draft: Callable[[], DraftPass], store: Any, *,
                   agree: Callable[[list[int]], list[int]], event: Callable[..., None],
                   share: RowShare = ONE_RANK, stored: StoredDraft = lambda r: (r.spec.start, 0)) -> list[int]:
    """Load the draft's stored KV of each restore (`stored`: where what it loaded ends, and its bytes; draft_kv.py),
    then rerun the draft over the rest, every tensor-parallel rank the same forwards (`agree`: the least of each
    value over the ranks) over the same rows (each rank read its `share`: `RowShare.gather`). Returns where each
    restore's draft ended (its start: not loaded, not run); vLLM computes the rest."""
    loaded = [_stored(r, stored, event) for r in restored]  # (where it ends, bytes, seconds)
    starts = agree([start for start, _, _ in loaded])  # every rank loaded at least this far
    found: list[tuple[torch.Tensor | None, int]] = []
    for r, start in zip(restored, starts, strict=True):
        try:
            found.append(draft().rows(replace(r.spec, start=start), r.job, r.kv, store, r.end, share)
                         if r.job and r.kv else (None, start))
        except Exception as exc:  # a rank without the draft model, say: no rank reruns this one's draft
            event("draft_error", req=r.spec.req_id, error=f"{type(exc).__name__}: {exc}")
            found.append((None, start))
    reached = agree([end for _, end in found])
    for r, (rows, _), start, (_, loaded_bytes, load_s), end in zip(restored, found, starts, loaded, reached,
                                                                   strict=True):
        started = gathered = time.perf_counter()
        if rows is not None and r.kv is not None and end > start:  # so on every rank (`agree`)
            rows = share.gather(rows[: end - start])
            gathered = time.perf_counter()
            draft().run(replace(r.spec, start=start), r.kv, rows, end)
        event("draft", req=r.spec.req_id, tokens=max(0, end - start), loaded=start - r.spec.start,
              short=r.end - end, elapsed_s=load_s + time.perf_counter() - started, load_s=load_s,
              gather_s=gathered - started, bytes_read=r.kv.draft_bytes_read if r.kv is not None else 0,
              loaded_bytes=loaded_bytes)
    return reached


def _stored(r: Restored, stored: StoredDraft, event: Callable[..., None]) -> tuple[int, int, float]:
    """Where the stored draft KV loaded for `r` ends, its bytes (from its start where none could be), and the
    seconds it took."""
    started = time.perf_counter()
    if r.job is None or r.kv is None:
        return r.spec.start, 0, 0.0
    try:
        end, n_bytes = stored(r)
    except Exception as exc:  # its pod unreachable, say: the draft reruns over all of it
        event("draft_error", req=r.spec.req_id, error=f"{type(exc).__name__}: {exc}")
        end, n_bytes = r.spec.start, 0
    return end, n_bytes, time.perf_counter() - started


def _next(spec: LoadSpec, end: int) -> tuple[int, ...]:
    """The token after position end - 1: the prefix's own, or the prompt's next (`next_token`)."""
    if end < len(spec.token_ids):
        return (spec.token_ids[end],)
    if spec.next_token is None:
        raise ValueError(f"restore of {spec.req_id}: no token after its prefix, which the draft's last input needs")
    return (spec.next_token,)
