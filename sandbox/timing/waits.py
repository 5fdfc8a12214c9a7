"""How long a timed process waited for a core: the machine's load, read by the judge (issues 65 and 69).

A timing on the CPU measures wall time, and wall time is the process's own work plus whatever it waited for while
other work held the cores. Load does not slow the two sides of a pairing alike: an MCP client's task check spinning
four threads made a profile `ok` with a wrong score (an honest kernel timed 120x slower than alone, and once
0.00226x eager where it runs at about 0.8x), because the candidate's OpenMP threads waited at every barrier while
eager, one thread at that size, kept a core. The kernel counts that wait for every thread: the second field of
/proc/<pid>/task/<tid>/schedstat is the time it spent runnable but not running (run-queue delay, ns), the first the
time it ran. Read by the judge's process before and after each timed batch, over the timed process's whole tree
(nothing the candidate can write), `waited` = delay / (ran + delay) over the batch: 0 on a quiet machine, 0.99 for a
thread that got a hundredth of a core. A batch that waited a share w of its time took up to 1 / (1 - w) of its time
alone, so two batches' waits bound how far the load moved their ratio (load_factor).
"""

from __future__ import annotations

import os
from contextlib import suppress

from sandbox.confinement import proctree

Sample = dict[tuple[int, int], tuple[int, int]]  # (pid, tid) -> (ns ran, ns waited to run)


def sample(pid: int) -> Sample | None:
    """Every thread of `pid` and its descendants: what it ran and waited so far. None where /proc says nothing
    (the process gone, a kernel without schedstat, a pid that is no process: a scripted timer's)."""
    if pid <= 0:
        return None
    out: Sample = {}
    for p in [pid, *proctree.descendants(pid)]:
        with suppress(OSError):
            for tid in os.listdir(f"/proc/{p}/task"):
                with suppress(OSError, ValueError):
                    with open(f"/proc/{p}/task/{tid}/schedstat") as fh:
                        ran, waited, _ = fh.read().split()
                    out[(p, int(tid))] = (int(ran), int(waited))
    return out or None


def waited(before: Sample | None, after: Sample | None) -> float | None:
    """The share of the tree's runnable time between two samples spent waiting for a core (None: not read). A thread
    that started in between counts from 0; one that ended is lost, with its time (it no longer runs)."""
    if before is None or after is None:
        return None
    ran = wait = 0
    for key, (r, w) in after.items():
        r0, w0 = before.get(key, (0, 0))
        ran, wait = ran + max(r - r0, 0), wait + max(w - w0, 0)
    return wait / (ran + wait) if ran + wait > 0 else 0.0


def slowed(share: float | None) -> float:
    """How much slower than alone a batch that waited `share` of its time may have run: 1 / (1 - share)."""
    if share is None:
        return 1.0
    return 1.0 / max(1.0 - share, 1e-6)


def load_factor(a: float | None, b: float | None) -> float | None:
    """How far the load could have moved the ratio of two batches' times that waited shares a and b (>= 1; None
    where either was not read)."""
    if a is None or b is None:
        return None
    x, y = slowed(a), slowed(b)
    return max(x, y) / min(x, y)


def mean(shares: list[float | None]) -> float | None:
    got = [s for s in shares if s is not None]
    return sum(got) / len(got) if got else None


def pairing_factor(eager_batches: list[dict], cand_batches: list[dict]) -> float | None:
    """The largest factor by which the machine's load could have moved a paired round's speedup: each candidate
    batch's wait against the mean of the eager batches' either side (sandbox/timing/paired.py's rounds). None where
    the waits were not read (CUDA: there the two sides take one core in turn, and the device does the work)."""
    out = None
    for i, c in enumerate(cand_batches[: max(len(eager_batches) - 1, 0)]):
        f = load_factor(c.get("waited"), mean([eager_batches[i].get("waited"), eager_batches[i + 1].get("waited")]))
        if f is not None:
            out = f if out is None else max(out, f)
    return out
