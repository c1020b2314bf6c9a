"""The coalescing of status refreshes after child events (the operator's handlers run them in kopf's threads)."""

from __future__ import annotations

import threading

from cacheflow_operator.coalesce import Coalescer


def test_events_queued_behind_a_running_refresh_share_the_next_one():
    c = Coalescer()
    first = c.arrive("demo")
    started = c.start("demo")  # the first event's refresh starts reading
    second, third = c.arrive("demo"), c.arrive("demo")  # two more arrive while it reads
    c.finish("demo", started)
    assert c.covered("demo", first)
    assert not c.covered("demo", second) and not c.covered("demo", third)  # it read before they arrived
    started = c.start("demo")  # the second event's refresh
    c.finish("demo", started)
    assert c.covered("demo", third)  # the third needs none of its own
    assert not c.covered("other", c.arrive("other"))  # keys are apart


def test_a_burst_of_events_in_threads_takes_at_most_two_refreshes_and_the_last_starts_after_every_event():
    c, lock, refreshes = Coalescer(), threading.Lock(), []
    arrivals, all_arrived = iter(range(1, 21)), threading.Event()

    def on_event() -> None:
        ticket = c.arrive("demo")
        if next(arrivals) == 20:
            all_arrived.set()
        with lock:
            if c.covered("demo", ticket):
                return
            started = c.start("demo")
            all_arrived.wait(10)  # the first refresh's reads last until the whole burst has arrived
            refreshes.append(started)
            c.finish("demo", started)

    threads = [threading.Thread(target=on_event) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(refreshes) <= 2 and refreshes[-1] == 20  # the last refresh started after every event
