"""Checkpoint fingerprints, hashed once and kept next to the files they describe.

Hashing every byte of a large checkpoint takes a while, so the result is kept in a small sidecar file,
`.cacheflow-fingerprint.json` in the checkpoint directory, keyed by the size and mtime of every file the
fingerprint reads: a file that changes is hashed again. Where the directory cannot be written, the
sidecar goes to the CacheFlow cache directory (`$CACHEFLOW_CACHE`, else `~/.cache/cacheflow`), and where
that fails too, it is kept in this process's memory only.

Processes that start together on a new checkpoint (vLLM's scheduler and every tensor-parallel rank, stage
workers on one volume) hash it once between them: the first takes an exclusive lock beside the sidecar
(`flock`, released if it dies) and hashes; the others wait for the lock, then read its sidecar.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cacheflow_common.files import write_atomically
from cacheflow_common.model.smollm2 import cache_root

log = logging.getLogger(__name__)
SIDECAR = ".cacheflow-fingerprint.json"
SIDECAR_FORMAT = 1

Stamps = dict[str, list[int]]  # file name (relative to the checkpoint) -> [size, mtime_ns]
_MEMORY: dict[tuple[str, str], tuple[Stamps, str]] = {}  # (checkpoint, variant) -> (stamps, fingerprint)


def file_stamps(root: Path, files: Iterable[Path]) -> Stamps:
    """Size and mtime (ns) of each file, by its name relative to `root`."""
    stamps: Stamps = {}
    for file in sorted(set(files)):
        st = file.stat()
        stamps[str(file.relative_to(root))] = [st.st_size, st.st_mtime_ns]
    return stamps


def sidecar_paths(root: Path) -> list[Path]:
    """Where a checkpoint's fingerprints are kept, in the order they are tried."""
    resolved = str(root.resolve())
    tag = hashlib.blake2b(resolved.encode(), digest_size=8).hexdigest()
    return [root / SIDECAR, cache_root() / "fingerprints" / f"{tag}.json"]


def cached_fingerprint(root: Path, files: Iterable[Path], variant: str, compute: Callable[[], str]) -> str:
    """The fingerprint `compute()` gives for the checkpoint `root` (its `files`) and `variant` (the dtype),
    from the cache while no file changed size or mtime since it was computed."""
    files = list(files)
    stamps = file_stamps(root, files)
    key = (str(root.resolve()), variant)
    remembered = _MEMORY.get(key)
    if remembered is not None and remembered[0] == stamps:
        return remembered[1]
    fp = _kept(root, stamps, variant)
    if fp is None:
        with _hashing(root):  # another process may be hashing it: wait for its sidecar
            fp = _kept(root, stamps, variant)
            if fp is None:
                fp = compute()
                if file_stamps(root, files) != stamps:  # changed while we read it: use the result, keep nothing
                    log.warning("checkpoint %s changed while it was fingerprinted; not caching its fingerprint",
                                root)
                    return fp
                _keep(root, stamps, variant, fp)
    _MEMORY[key] = (stamps, fp)
    return fp


def _kept(root: Path, stamps: Stamps, variant: str) -> str | None:
    """The fingerprint a sidecar holds for these files and `variant`, if any."""
    for sidecar in sidecar_paths(root):
        entry = _read_sidecar(sidecar)
        if entry.get("files") == stamps and variant in entry.get("fingerprints", {}):
            return str(entry["fingerprints"][variant])
    return None


@contextmanager
def _hashing(root: Path) -> Iterator[None]:
    """Hold the exclusive lock on hashing `root`, in the first place beside a sidecar where one can be taken
    (without one where none can: each process then hashes on its own)."""
    for sidecar in sidecar_paths(root):
        fd = _locked(sidecar.with_name(sidecar.name + ".lock"))
        if fd is None:
            continue
        try:
            yield
        finally:
            os.close(fd)  # releases the lock
        return
    log.info("no place to lock hashing %s in; hashing it without the lock", root)
    yield


def _locked(path: Path) -> int | None:
    """A descriptor of `path` (created if absent) holding its exclusive lock, waiting for it; None where the
    file cannot be opened or locked (a read-only place, a file system without locks)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def _read_sidecar(path: Path) -> dict[str, Any]:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):  # absent, unreadable or torn: as if absent
        return {}
    if not isinstance(entry, dict) or entry.get("format") != SIDECAR_FORMAT:
        return {}
    return entry


def _keep(root: Path, stamps: Stamps, variant: str, fp: str) -> None:
    """Write the sidecar in the first place that takes it (other variants of the same files kept)."""
    for sidecar in sidecar_paths(root):
        entry = _read_sidecar(sidecar)
        known = entry.get("fingerprints", {}) if entry.get("files") == stamps else {}
        body = {"format": SIDECAR_FORMAT, "files": stamps, "fingerprints": {**known, variant: fp}}
        try:
            write_atomically(sidecar, json.dumps(body, indent=1, sort_keys=True))
            return
        except OSError as exc:
            log.info("cannot keep the fingerprint of %s in %s (%s); trying the next place", root, sidecar, exc)
    log.warning("fingerprint of %s kept in memory only: no place to write it", root)


