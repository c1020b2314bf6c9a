"""Where a reader's KV heads are when the chunk was stored with the heads split another way.

A tensor-parallel instance stores each rank's KV heads as objects of their own (`object_name`'s ".H2-4"); an
instance of another tensor-parallel size, or one without (all heads in one object), reads the same chunks:
the heads it needs, [a, b) of the model's H, come from the objects of any split of H into n equal runs that
the store holds whole ("a layout n": n = 1 is one object of all heads). Of a layout, the reader reads the
runs that meet [a, b) and keeps their heads in [a, b): runs inside it land whole, a run reaching past it
lands in part (its other heads are read and dropped).

Layouts are tried in order of the bytes they make the reader read, then of their objects: a reader's own
split first (exactly its heads, one object), then finer ones (exactly its heads, more objects), then coarser.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from cacheflow_common.kv.chunk import ChunkLayout
from cacheflow_common.kv.keys import ChunkKey, HeadRange, object_name


@dataclass(frozen=True)
class HeadPart:
    """One stored object holding some of a reader's heads."""

    name: str
    layout: ChunkLayout  # the object's (its heads)
    take: slice  # its heads the reader keeps, among its own
    dst: slice  # where they land, among the reader's heads


def head_splits(total: int) -> list[int]:
    """Every n that splits `total` KV heads into equal runs."""
    return [n for n in range(1, total + 1) if total % n == 0]


def layout_parts(want: HeadRange, n: int) -> list[HeadRange]:
    """The runs of layout n (the model's heads split n ways) that hold any of `want`."""
    return [part for part in want.parts(n) if part.start < want.stop and want.start < part.stop]


def splits_in_order(want: HeadRange) -> list[int]:
    """The layouts that can serve `want`, fewest bytes read first, then fewest objects."""
    def cost(n: int) -> tuple[int, int]:
        parts = layout_parts(want, n)
        return sum(p.count for p in parts), len(parts)
    return sorted(head_splits(want.total), key=cost)


def parts_of(key: ChunkKey, layout: ChunkLayout, want: HeadRange, n: int) -> list[HeadPart]:
    """How `want` comes out of layout n's objects of the chunk `key` (`layout`: the reader's own, `want`'s heads)."""
    parts = []
    for part in layout_parts(want, n):
        lo, hi = max(part.start, want.start), min(part.stop, want.stop)
        parts.append(HeadPart(name=object_name(key, layout.kind, layout.layer_start, layout.layer_end, part),
                              layout=replace(layout, num_kv_heads=part.count, heads=part),
                              take=slice(lo - part.start, hi - part.start),
                              dst=slice(lo - want.start, hi - want.start)))
    return parts


def stored_parts(key: ChunkKey, layout: ChunkLayout, want: HeadRange, size: Callable[[str], int | None],
                 *, skip: int = 0) -> list[HeadPart] | None:
    """The cheapest layout whose objects of `want` are all stored whole (`size`: the store's), but layout
    `skip` (one already found missing); None if none is."""
    for n in splits_in_order(want):
        if n == skip:
            continue
        parts = parts_of(key, layout, want, n)
        if all(p.layout.stored_whole(size(p.name)) for p in parts):
            return parts
    return None


def split_of(heads: HeadRange) -> int:
    """The layout a run of heads belongs to: n for a 1/n share of the model's heads."""
    return heads.total // heads.count
