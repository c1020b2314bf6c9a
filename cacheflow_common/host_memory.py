"""Short-lived host buffers as large as a chunk object, each mapped from the kernel for its own use.

A freed heap block stays with the allocator: glibc keeps the free top of each thread's arena below a trim
threshold that grows with the largest block freed, and `malloc_trim` hands back only the main arena's top. A
saver thread that encodes one chunk object at a time would keep its largest working set resident for the life
of the process (inside vLLM's, for the connector). A buffer mapped for itself is unmapped when its last view
is released: its pages go back at once. Small buffers stay on the heap (a mapping costs a system call and a
page).
"""

from __future__ import annotations

import mmap

MAPPED_MIN_BYTES = 256 * 1024  # glibc's own first mmap threshold is 128 KiB; below this the heap's reuse wins


def host_buffer(nbytes: int) -> memoryview:
    """A writable, zero-filled buffer of `nbytes` (format "B"); one of at least `MAPPED_MIN_BYTES` is a private
    anonymous mapping, returned to the system when the last view of it is released."""
    if nbytes < MAPPED_MIN_BYTES:
        return memoryview(bytearray(nbytes))
    return memoryview(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE))
