"""One CPU core for a CUDA profile's paired timing.

A launch-bound call is mostly host path (the Python forward, the binding, the launch), and the scheduler puts
eager's process and the candidate's wherever it likes: on an idle H200 the same honest relu on a [32, 64] input
was timed 0.81x eager in one profile and over 1.1x in the two before it. While the paired rounds run, both
processes (every thread, and anything they started) are held to one core, the same for both, so the two host
paths are measured on the same core; each side is stopped while the other is timed, so the core is the active
side's alone; the judge's other CUDA workers keep off it (keep_off_timing_cores), as builds do. The core is
chosen by GPU, so that timings of a host's GPUs that run at once use different ones.
Not on the CPU backend: there the work is the cores' own, and eager's threads need all of them.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from sandbox.confinement import proctree


def gpu_count() -> int:
    """The host's GPUs as the driver's device files show them (no torch, no CUDA context); at least 1."""
    try:
        names = os.listdir("/dev")
    except OSError:
        names = []
    return max(1, sum(1 for n in names if n.startswith("nvidia") and n[6:].isdigit()))


def core_for(gpu: str | None, allowed: list[int], gpus: int | None = None) -> int:
    """The core a GPU's timings use: counted from the last (the first cores take the most system work). A GPU
    named otherwise than by its index (a UUID, a list) still gets one of the host's `gpus` timing cores."""
    key = gpu or "0"
    n = gpus if gpus is not None else gpu_count()
    index = int(key) if key.isdigit() else zlib.crc32(key.encode()) % max(1, n)
    return allowed[-1 - index % len(allowed)]


def _siblings(core: int) -> set[int]:
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{core}/topology/thread_siblings_list").read_text()
    except OSError:
        return {core}
    out: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        with suppress(ValueError):
            out.update(range(int(lo), int(hi or lo) + 1))
    return out or {core}


def build_cores(allowed: list[int] | None = None, gpus: int | None = None, siblings=_siblings) -> set[int] | None:
    """The cores a CUDA build may use beside timings: all but every GPU's timing core and its hyperthread
    siblings. None where that leaves fewer than two (a small machine: builds then wait for timings as before).

    A small kernel's time on CUDA is mostly the host's launch path, and a timing beside eleven nvcc builds once
    failed the judge's wall-clock bound; so builds held the device lock shared and waited for every timing,
    and every timing waited for every build in flight (up to 17 s queued with eight judgments on an H100).
    A timing's processes are held to their GPU's core (one_core); builds kept off those cores run beside it."""
    if allowed is None:
        try:
            allowed = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            return None
    if len(allowed) < 2:
        return None
    n = gpus if gpus is not None else gpu_count()
    reserved: set[int] = set()
    for g in range(min(n, len(allowed))):
        reserved |= siblings(core_for(str(g), allowed, n))
    free = set(allowed) - reserved
    return free if len(free) >= 2 else None


def keep_off_timing_cores(cpus: set[int] | None = None) -> set[int] | None:
    """Hold every thread of this process (and whatever it starts later) to `cpus`, by default the cores builds use:
    a CUDA worker calls it before it opens the device. The cores left out are the GPUs' timing cores, which a
    timing's two processes take (one_core) and nothing else of the judge's should share: a worker setting up, or a
    pooled one importing torch._dynamo, beside a launch-bound timing slows the host path being measured. The
    set applied, or None where there is none to apply or it is refused."""
    if cpus is None:
        cpus = build_cores()
    if not cpus:
        return None
    done = False
    for tid in _threads(os.getpid()):
        with suppress(OSError):
            os.sched_setaffinity(tid, cpus)
            done = True
    return cpus if done else None


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
