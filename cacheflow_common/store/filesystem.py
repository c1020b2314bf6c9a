"""A durable filesystem store: each object is one file, written atomically and fsynced.

`put` writes a temporary file in the object's own directory, fsyncs it, renames it over the final
name (`os.replace`, atomic) and fsyncs the directory: once `put` returns the object survives a
crash, and a reader sees either the old object or the new one, never half of one. Objects are
spread over subdirectories named by the first two characters of their names (256 for hex keys).

`read_into` and `readv_into` read straight into the caller's buffers with `os.preadv` (no intermediate
copy, no shared file offset, so any number of threads may read at once), looping over short reads.
Temporary files start with a dot, which no object name may, so they never collide with objects.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from cacheflow_common.errors import BadRequestError, StoreError
from cacheflow_common.kv.keys import valid_name
from cacheflow_common.store.base import IOV_MAX, byte_views, views_after

_TMP_PREFIX = ".tmp-"  # object names never start with a dot
_SHARD_CHARS = 2  # 2 hex characters: 256 directories, a few thousand files each at a million objects


class FilesystemStore:
    name = "filesystem"

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot create store directory {self.root}: {exc}") from exc

    def _path(self, name: str) -> Path:
        if not valid_name(name):
            raise BadRequestError(f"invalid object name {name!r}")
        return self.root / name[:_SHARD_CHARS] / name

    def _path_or_none(self, name: str) -> Path | None:
        return self.root / name[:_SHARD_CHARS] / name if valid_name(name) else None

    def put(self, name: str, data: bytes | memoryview) -> None:
        path = self._path(name)
        src = memoryview(data).cast("B")  # [nbytes]
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(exist_ok=True)
                _fsync_dir(self.root)  # the new shard directory's entry must survive too
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_PREFIX)
        except OSError as exc:
            raise StoreError(f"cannot store {name}: {exc}") from exc
        try:
            try:
                done = 0
                while done < len(src):
                    done += os.write(fd, src[done:])
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            _fsync_dir(path.parent)
        except OSError as exc:
            _unlink_quietly(tmp)
            raise StoreError(f"cannot store {name}: {exc}") from exc
        except BaseException:  # interrupted (KeyboardInterrupt, ...): leave no temporary file behind
            _unlink_quietly(tmp)
            raise

    def read_into(self, name: str, buf: memoryview, offset: int = 0) -> bool:
        return self.readv_into(name, [buf], offset)

    def readv_into(self, name: str, views: Sequence[memoryview], offset: int = 0) -> bool:
        path = self._path_or_none(name)
        if path is None or offset < 0:
            return False
        out, length = byte_views(views)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            done = 0
            while done < length:
                n = os.preadv(fd, views_after(out, done)[:IOV_MAX], offset + done)
                if n <= 0:
                    return False  # the object is shorter than asked: a miss
                done += n
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    def read(self, name: str) -> bytes | None:
        path = self._path_or_none(name)
        if path is None:
            return None
        try:
            return path.read_bytes()
        except OSError:
            return None

    def size(self, name: str) -> int | None:
        path = self._path_or_none(name)
        if path is None:
            return None
        try:
            st = path.stat()
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def exists(self, name: str) -> bool:
        return self.size(name) is not None

    def delete(self, name: str) -> None:
        path = self._path(name)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise StoreError(f"cannot delete {name}: {exc}") from exc

    def names(self) -> Iterator[str]:
        """Every stored object's name (tools and tests; temporary files are skipped)."""
        for shard in sorted(self.root.iterdir()):
            if shard.is_dir():
                yield from sorted(p.name for p in shard.iterdir() if valid_name(p.name))

    def entries(self) -> list[tuple[str, int]]:
        """(name, size) of every object, least recently written first: the order an LRU index starts from."""
        found: list[tuple[float, str, int]] = []
        for name in self.names():
            with contextlib.suppress(OSError):  # removed since listed
                st = (self.root / name[:_SHARD_CHARS] / name).stat()
                found.append((st.st_mtime, name, st.st_size))
        return [(name, size) for _, name, size in sorted(found)]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    """Remove a temporary file on the way out of a failed write (the write's own error is what matters)."""
    with contextlib.suppress(OSError):
        os.unlink(path)
