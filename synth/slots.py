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


class Faults:
    """A stage's own failures: an exception in the pipeline (the judge's processes, the machine) rather than a
    verdict on the task. Such a task is left undecided, so that the build stays incomplete and a resumed one
    tries it again: recorded as a drop, it would be lost from the set for a fault that was not its own (a gate
    that ran out of descriptors "dropped" 1,453 tasks in a row and called the build complete). After `limit` in a
    row the stage starts no more tasks: every further one would fail the same way."""

    LIMIT = 8

    def __init__(self, limit: int = LIMIT):
        self.limit = limit
        self.in_row = self.total = 0
        self.last = ""

    def note(self, error: str | None) -> None:
        """After each finished task: its fault, or None where it was decided."""
        if error is None:
            self.in_row = 0
            return
        self.in_row += 1
        self.total += 1
        self.last = error

    @property
    def tripped(self) -> bool:
        return self.in_row >= self.limit

    def notes(self, stage: str) -> list[str]:
        if not self.total:
            return []
        stopped = f"; stopped after {self.in_row} in a row" if self.tripped else ""
        return [f"{self.total} tasks left undecided by the {stage}'s own errors{stopped} (a resumed build tries "
                f"them again); the last: {self.last[:300]}"]
