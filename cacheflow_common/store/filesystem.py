"""A durable filesystem store: each object is one file, written atomically and fsynced.

Writes go to a temporary file in the target directory, are flushed and fsynced, then renamed over
the final name, and the directory is fsynced: after `put` returns, the object survives a crash, and
a reader never sees a half-written object. Objects are spread over 256 subdirectories by name.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from cacheflow_common.errors import BadRequestError, StoreError
from cacheflow_common.kv.keys import valid_name


class FilesystemStore:
    name = "filesystem"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        if not valid_name(name):
            raise BadRequestError(f"invalid object name {name!r}")
        return self.root / name[:2] / name

    def put(self, name: str, data: bytes | memoryview) -> None:
        path = self._path(name)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as exc:
            Path(tmp).unlink(missing_ok=True)
            raise StoreError(f"cannot store {name}: {exc}") from exc

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        try:
            fd = os.open(self._path(name), os.O_RDONLY)
        except (OSError, BadRequestError):
            return False
        try:
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done:]], offset + done)
                if n <= 0:
                    return False  # the object is shorter than asked: a miss
                done += n
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def read(self, name: str) -> bytes | None:
        try:
            return self._path(name).read_bytes()
        except (OSError, BadRequestError):
            return None

    def size(self, name: str) -> int | None:
        try:
            return self._path(name).stat().st_size
        except (OSError, BadRequestError):
            return None

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def delete(self, name: str) -> None:
        self._path(name).unlink(missing_ok=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
