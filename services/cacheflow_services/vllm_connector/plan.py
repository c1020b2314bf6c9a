"""The scheduler side's decisions, as plain data: which requests load a cached prefix this step, and
which whole prompt chunks to store.

vLLM asks the connector how many tokens past its own prefix-cache hit it can provide
(`matched`); after allocating blocks it says how many it will take (`allocated`); when it builds a step
it hands over each scheduled request (`new_request`, `running_request`), and this turns them into
`LoadSpec`s (restore the prefix before the forward pass) and `SaveSpec`s (store the chunks this step
completes, after it). vLLM only takes external tokens as a prefix of the prompt, so the whole cached
prefix comes from CacheFlow: its front recomputed by CacheFlow, its back loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Adapter:
    """A request's LoRA adapter as vLLM names it (its `LoRARequest`): what a worker activates to recompute."""

    name: str
    lora_id: int  # vLLM's int id (0 is the base model)
    path: str


@dataclass(frozen=True)
class LoadSpec:
    req_id: str
    token_ids: tuple[int, ...]  # the cached prefix, tokens [0, N): whole chunks
    block_ids: tuple[int, ...]  # the request's vLLM blocks, from position 0
    start: int  # vLLM's own prefix-cache hit ends here: only positions [start, N) are written
    salt: str = ""  # what else its chunk keys are salted with (a LoRA adapter, a cache_salt: support.py)
    load_only: bool = False  # restored by loads alone (nothing may recompute it: support.py, adapters.py)
    adapter: Adapter | None = None  # its LoRA adapter (None: the base model), active while it recomputes
    next_token: int | None = None  # the prompt's token after the prefix (an EAGLE draft's last input: draft.py)


@dataclass(frozen=True)
class SaveSpec:
    req_id: str
    token_ids: tuple[int, ...]  # prompt tokens [0, end): `end` a multiple of the chunk size
    block_ids: tuple[int, ...]
    start: int  # first token to store (a chunk boundary); the chunks before it are stored already
    salt: str = ""  # as its LoadSpec's
    next_token: int | None = None  # the prompt's token at `end` (None: `end` is the prompt's end)


@dataclass(frozen=True)
class Keying:
    """How a request's chunks are keyed and restored (support.py decides)."""

    salt: str = ""
    load_only: bool = False
    adapter: Adapter | None = None

    def load_spec(self, req_id: str, prompt: tuple[int, ...], cached: int, block_ids: tuple[int, ...], start: int
                  ) -> LoadSpec:
        """A load of the `cached` prefix of `prompt`, keyed and restored this way."""
        return LoadSpec(req_id, prompt[:cached], block_ids, start, salt=self.salt, load_only=self.load_only,
                        adapter=self.adapter, next_token=prompt[cached] if cached < len(prompt) else None)


@dataclass
class PromptRows:
    """Where one step writes the prompt rows of the requests it computes: the blocks those rows land in,
    each with its request, the position of its first slot and the request's prompt length (decode rows,
    past the prompt, are never stored)."""

    block_size: int
    blocks: dict[int, tuple[str, int, int]] = field(default_factory=dict)

    def add(self, req_id: str, block_ids: Sequence[int], start: int, end: int, prompt_len: int) -> None:
        """The request's rows for positions [start, end) (clipped to its prompt), its blocks from position 0."""
        end = min(end, prompt_len)
        last = min(-(-end // self.block_size), len(block_ids)) if end > start else 0
        for index in range(start // self.block_size, last):
            # A block two requests share (a cached one whose last token vLLM recomputes) holds one prefix:
            # either request's row is the same activation.
            self.blocks[block_ids[index]] = (req_id, index * self.block_size, prompt_len)

    def owner(self, slot: int) -> tuple[str, int] | None:
        """(request, position) of the prompt row written to `slot`, or None (padding, decode, not ours)."""
        entry = self.blocks.get(slot // self.block_size) if slot >= 0 else None
        if entry is None:
            return None
        req_id, first, prompt_len = entry
        position = first + slot % self.block_size
        return (req_id, position) if position < prompt_len else None


@dataclass
class _Tracked:
    prompt: tuple[int, ...]
    block_ids: list[int]
    saved: int  # prompt tokens [0, saved) are stored, or on their way
    keying: Keying


# (prompt token ids, limit, salt) -> tokens [0, n) whose whole chunks the pods hold, n <= limit
Lookup = Callable[[Sequence[int], int, str], int]


class SchedulerPlan:
    def __init__(self, *, chunk_size: int, block_size: int, lookup: Lookup, save: bool) -> None:
        if chunk_size % block_size:
            raise ValueError(f"chunk_size {chunk_size} must be a multiple of vLLM's block size {block_size}")
        self.chunk_size = chunk_size
        self.block_size = block_size
        self.lookup = lookup
        self.save = save
        self._cached: dict[str, int] = {}  # request -> cached prefix tokens, from its lookup
        self._loads: dict[str, int] = {}  # request -> first position to load (vLLM holds the ones before)
        self._tracked: dict[str, _Tracked] = {}
        self._background: list[LoadSpec] = []  # loads to start in the background, at the next step
        self._loaded_in_background: set[str] = set()  # requests offered their one background load
        self._keying: dict[str, Keying] = {}  # request -> its keying, from `matched`

    def matched(self, req_id: str, prompt: Sequence[int], num_computed: int, keying: Keying = Keying()) -> int:
        """Tokens past vLLM's own `num_computed` that CacheFlow can provide (at least one prompt token is
        left for vLLM to compute: it needs the last one's logits). A request whose background load has run is
        offered nothing more: vLLM asks again after that load failed (and recomputes), or after a preemption."""
        if req_id in self._loaded_in_background:
            return 0
        self._keying[req_id] = keying
        if req_id not in self._cached:
            self._cached[req_id] = self.lookup(prompt, len(prompt) - 1, keying.salt)
        return max(0, self._cached[req_id] - num_computed)

    def allocated(self, req_id: str, num_external: int) -> None:
        if num_external > 0:
            self._loads[req_id] = self._cached[req_id] - num_external

    def allocated_in_background(self, req_id: str, prompt: Sequence[int], block_ids: Sequence[int],
                                num_external: int) -> None:
        """vLLM allocated blocks for a load that runs in the background while the request waits (it is
        scheduled only once the load finished); the load starts with the next step."""
        if num_external <= 0:
            return
        cached = self._cached.pop(req_id)
        self._loaded_in_background.add(req_id)
        tracked = _Tracked(tuple(prompt), list(block_ids), saved=cached, keying=self.keying(req_id))
        self._tracked[req_id] = tracked
        self._background.append(tracked.keying.load_spec(req_id, tracked.prompt, cached, tuple(block_ids),
                                                         cached - num_external))

    def take_background_loads(self) -> list[LoadSpec]:
        loads, self._background = self._background, []
        return loads

    def new_request(self, req_id: str, prompt: Sequence[int], block_ids: Sequence[int], computed_after: int
                    ) -> tuple[LoadSpec | None, SaveSpec | None]:
        """A request scheduled for the first time; `computed_after`: its tokens with KV after this step."""
        tracked = self._tracked.get(req_id)
        if tracked is not None:  # its prefix was restored in the background before this first schedule
            tracked.block_ids = list(block_ids)
            return None, self._save(req_id, tracked, computed_after)
        cached = self._cached.pop(req_id, 0)
        tracked = _Tracked(tuple(prompt), list(block_ids), saved=cached, keying=self.keying(req_id))
        self._tracked[req_id] = tracked
        return self._load(req_id, tracked, cached), self._save(req_id, tracked, computed_after)

    def running_request(self, req_id: str, new_block_ids: Sequence[int] | None, *, resumed: bool,
                        computed_after: int) -> tuple[LoadSpec | None, SaveSpec | None]:
        """A request scheduled again (`resumed` after a preemption: `new_block_ids` are all its blocks)."""
        tracked = self._tracked.get(req_id)
        if tracked is None:
            return None, None
        if resumed:
            tracked.block_ids = list(new_block_ids or ())
        elif new_block_ids:
            tracked.block_ids.extend(new_block_ids)
        cached = self._cached.pop(req_id, 0)
        return self._load(req_id, tracked, cached), self._save(req_id, tracked, computed_after)

    def add_prompt_rows(self, rows: PromptRows, req_id: str, start: int, end: int) -> None:
        """Where the request's rows for positions [start, end) go this step (after `new_request` or
        `running_request` gave its blocks), for the pipeline ranks that capture boundary activations."""
        tracked = self._tracked.get(req_id)
        if tracked is not None:
            rows.add(req_id, tracked.block_ids, start, end, len(tracked.prompt))

    def keying(self, req_id: str) -> Keying:
        """How the request's chunks are keyed and restored (a request vLLM never asked about: plainly)."""
        return self._keying.get(req_id, Keying())

    def known_keying(self, req_id: str) -> Keying | None:
        """The keying `matched` was given for the request, or None before its first ask."""
        return self._keying.get(req_id)

    def finished(self, req_id: str) -> None:
        self._keying.pop(req_id, None)
        self._loaded_in_background.discard(req_id)
        self._cached.pop(req_id, None)
        self._loads.pop(req_id, None)
        self._tracked.pop(req_id, None)

    def _load(self, req_id: str, tracked: _Tracked, cached: int) -> LoadSpec | None:
        start = self._loads.pop(req_id, None)
        if start is None:
            return None
        return tracked.keying.load_spec(req_id, tracked.prompt, cached, tuple(tracked.block_ids), start)

    def _save(self, req_id: str, tracked: _Tracked, computed_after: int) -> SaveSpec | None:
        end = min(computed_after, len(tracked.prompt)) // self.chunk_size * self.chunk_size
        if not self.save or end <= tracked.saved:
            return None
        spec = SaveSpec(req_id, tracked.prompt[:end], tuple(tracked.block_ids), tracked.saved, salt=tracked.keying.salt,
                        next_token=tracked.prompt[end] if end < len(tracked.prompt) else None)
        tracked.saved = end
        return spec
