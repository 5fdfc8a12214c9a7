"""Tasks over worker slots under a time limit: the filter's and the gate's loop.

Tasks are handed to the pool only as slots free up, and none once the limit has passed, so a build
stopped by --time-limit has started no task after it (a pool given every task at once starts the next
one the moment a slot frees, before anyone can cancel it). The first `slots` tasks start even past the
limit: every invocation of a resumed build decides something, however short its limit. A pool given
more tasks than it runs at once (Ray's actors queue theirs) has the unstarted ones cancelled at the limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from typing import Any


def run_slots(pool: Executor, fn: Callable[[Any], Any], items: Iterable[Any], slots: int,
              expired: Callable[[], bool]) -> Iterator[tuple[Any, Future]]:
    """(item, its finished future) as each finishes; `slots` in flight at most."""
    todo = iter(items)
    running: dict[Future, Any] = {}

    def fill(first: bool = False) -> None:
        while len(running) < max(1, slots) and (first or not expired()):
            item = next(todo, _END)
            if item is _END:
                return
            running[pool.submit(fn, item)] = item

    fill(first=True)
    while running:
        done, _ = wait(running, return_when=FIRST_COMPLETED)
        for fut in done:
            item = running.pop(fut)
            if not fut.cancelled():
                yield item, fut
        fill()
        if expired():  # a pool given more than its slots (Ray's queue) drops what has not started
            for f in running:
                f.cancel()


_END = object()
