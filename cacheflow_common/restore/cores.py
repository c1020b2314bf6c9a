"""Keep I/O threads off the compute thread's cores.

On a GPU the two pointers use different hardware. On a CPU they share cores, and a host that binds its
compute thread to cores (vLLM's CPU worker pins its OpenMP thread and leaves the other cores to
connectors) leaves every thread it starts on the compute core too, since a thread inherits its
creator's binding: the loader would then steal time from the compute pointer it runs against. An I/O
thread calls `move_off_compute_cores()` first: it moves to the cores this process may use that its
creator was not bound to. Where nothing is bound (our own stage workers) there are none, and it stays.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
CGROUP_CPUS = Path("/sys/fs/cgroup/cpuset.cpus.effective")


def parse_cpu_list(text: str) -> set[int]:
    """'0-2,5' -> {0, 1, 2, 5} (the kernel's cpu list format)."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def usable_cpus() -> set[int]:
    """The cores this process's container lets it use (cgroup v2 cpuset, else every online core)."""
    try:
        cpus = parse_cpu_list(CGROUP_CPUS.read_text())
    except (OSError, ValueError):
        cpus = set()
    return cpus or set(range(os.cpu_count() or 1))


def move_off_compute_cores() -> set[int]:
    """Bind the calling thread to the usable cores outside its current binding; returns them (empty: unmoved)."""
    if not hasattr(os, "sched_setaffinity"):
        return set()
    spare = usable_cpus() - os.sched_getaffinity(0)
    if spare:
        try:
            os.sched_setaffinity(0, spare)
        except OSError as exc:  # a core listed but not allowed: stay, sharing the compute core
            log.debug("cannot move I/O thread to cores %s: %s", sorted(spare), exc)
            return set()
    return spare
