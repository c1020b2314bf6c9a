"""Small files written whole or not at all (profiles, fingerprints, the supervisor's state, secrets)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: Path, data: bytes | str) -> None:
    """Write `data` to `path` so that a reader (or a process started after a crash) sees the old file or
    the whole new one, never a part: a temporary file beside it, flushed to disk, then renamed over it.
    The file is readable by its owner only (mode 0600)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")  # mkstemp: mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
