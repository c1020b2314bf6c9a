"""Status refreshes after child events, coalesced per resource.

A refresh reads the resource and its workloads afresh, so one that starts after an event has arrived
covers that event. Each reconcile applies every child, and each apply is an event: without this, a
resource with 19 children queued 19 refreshes behind its lock, each reading 6 objects, after every
reconcile. Here the events that queued behind a running refresh share the next one.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Hashable


class Coalescer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arrived: defaultdict[Hashable, int] = defaultdict(int)  # events seen, per key
        self._covered: defaultdict[Hashable, int] = defaultdict(int)  # events a finished refresh started after

    def arrive(self, key: Hashable) -> int:
        """An event for `key`: its ticket."""
        with self._lock:
            self._arrived[key] += 1
            return self._arrived[key]

    def covered(self, key: Hashable, ticket: int) -> bool:
        """Whether a refresh that started after this ticket's event has finished (then it needs none)."""
        with self._lock:
            return self._covered[key] >= ticket

    def start(self, key: Hashable) -> int:
        """A refresh starts reading: it will cover every event that has arrived so far."""
        with self._lock:
            return self._arrived[key]

    def finish(self, key: Hashable, started_at: int) -> None:
        with self._lock:
            self._covered[key] = max(self._covered[key], started_at)
