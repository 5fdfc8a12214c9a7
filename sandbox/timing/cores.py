"""One CPU core for a CUDA profile's paired timing.

A launch-bound call is mostly host path (the Python forward, the binding, the launch), and the scheduler puts
eager's process and the candidate's wherever it likes: on an idle H200 the same honest relu on a [32, 64] input
was timed 0.81x eager in one profile and over 1.1x in the two before it. While the paired rounds run, both
processes (every thread, and anything they started) are held to one core, the same for both, so the two host
paths are measured on the same core; each side is stopped while the other is timed, so the core is the active
side's alone. The core is chosen by GPU, so that timings of a host's GPUs that run at once use different ones.
Not on the CPU backend: there the work is the cores' own, and eager's threads need all of them.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from sandbox.confinement import proctree


def core_for(gpu: str | None, allowed: list[int]) -> int:
    """The core a GPU's timings use: counted from the last (the first cores take the most system work)."""
    key = gpu or "0"
    index = int(key) if key.isdigit() else zlib.crc32(key.encode())
    return allowed[-1 - index % len(allowed)]


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


@contextmanager
def one_core(pids: list[int], gpu: str | None) -> Iterator[int | None]:
    """Hold every thread of `pids` and of their descendants to one core while inside; the core, or None where
    this machine gives the judge fewer than two (nothing to choose) or the call is refused."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = []
    if len(allowed) < 2:
        yield None
        return
    core = core_for(gpu, allowed)
    saved: dict[int, set[int]] = {}
    for pid in pids:
        for p in [pid, *proctree.descendants(pid)]:
            for tid in _threads(p):
                with suppress(OSError):
                    saved[tid] = os.sched_getaffinity(tid)
                    os.sched_setaffinity(tid, {core})
    try:
        yield core if saved else None
    finally:
        for tid, cpus in saved.items():
            with suppress(OSError):
                os.sched_setaffinity(tid, cpus)
