"""Measuring this machine for the restore policies: `cacheflow profile`, and the quick profile that
`cacheflow demo` and `cacheflow up` make on their first start and reuse afterwards.

Profiling runs in this process with the torch threads each worker will run, behind a progress bar
(on a terminal only).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from tqdm import tqdm

from cacheflow_common.engine import ProfileSettings, profile_model
from cacheflow_common.model.sources import load_model, parse_dtype
from cacheflow_common.restore.profile import PROFILE_FORMAT, Profile
from cacheflow_common.store.base import open_store


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block with `threads` torch threads, then restore the previous count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def measure(model: str, *, dtype: str, settings: ProfileSettings, threads: int, store: str = "memory") -> Profile:
    """Profile `model` (tiny | smollm2 | a directory) here, with a progress bar on a terminal."""
    with torch_threads(threads):
        loaded = load_model(model, dtype=parse_dtype(dtype))
        steps = 3 + len(settings.crossover_ratios)  # profile_model's steps: see its progress messages
        with tqdm(total=steps, disable=not sys.stderr.isatty(), desc=f"profiling {model}") as bar:
            started: list[str] = []

            def progress(step: str) -> None:  # told as each step starts: the one before is done
                bar.update(1 if started else 0)
                started.append(step)
                bar.set_postfix_str(step)

            profile = profile_model(loaded, store=open_store(store), settings=settings, model_name=model,
                                    progress=progress)
            bar.update(1)
    return profile


def quick_profile_path(cache_dir: Path, model: str, *, dtype: str, chunk_size: int, max_tokens: int,
                       threads: int) -> Path:
    """Where the quick profile of these settings is kept (one file per model, setting and profile format:
    a profile of an older format is measured again)."""
    name = model.strip("/").replace("/", "_")
    return cache_dir / f"profile-quick-{name}-{dtype}-c{chunk_size}-m{max_tokens}-t{threads}-f{PROFILE_FORMAT}.json"


def ensure_quick_profile(cache_dir: Path, model: str, *, dtype: str, chunk_size: int, max_tokens: int,
                         threads: int) -> Path:
    """A quick profile (`cacheflow profile --quick`) of `model` with `threads` torch threads (as each
    worker runs), measured on the first call and reused afterwards."""
    path = quick_profile_path(cache_dir, model, dtype=dtype, chunk_size=chunk_size, max_tokens=max_tokens,
                              threads=threads)
    if path.is_file():
        print(f"profile: {path} (measured before; delete it to measure again)", flush=True)
        return path
    print(f"profiling {model} on this machine (once; about a minute) ...", flush=True)
    measure(model, dtype=dtype, settings=ProfileSettings.quick(chunk_size, max_tokens), threads=threads).save(path)
    print(f"profile: {path}", flush=True)
    return path
