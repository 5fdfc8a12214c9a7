"""The real uid a judgment's processes share where their threads are bounded by RLIMIT_NPROC as root (no cgroup pids
group on the host, sandbox.confinement.nproc): CUDA IPC maps another process's memory only between processes of one
real uid, so a judgment's reference and candidate cannot each take one of their own.

The judge numbers them per judging process (nproc.SLOTS a process, nproc.exchange_uid): a session takes one at the
first request one of its workers sends (processes.Session), a task process kept between judgments keeps its uid,
and a session that takes a kept one takes its uid. A uid is free again when no live session holds it and no kept
process has it; the next one is taken round the slots, so one just freed (its processes may still be ending) is
the last to come back.
"""

from __future__ import annotations

import os
import threading

from sandbox.confinement import kept, nproc, pidgroup

_LOCK = threading.Lock()
_HELD: dict[int, int] = {}  # uid -> live sessions holding it
_NEXT = [0]


def needed(warm_device: str) -> bool:
    """Whether a session's workers on `warm_device` take a judgment's uid: as root, where no cgroup pids group can
    be had, on a device that is not the CPU (a CPU process takes a uid of its own), or as tests choose."""
    mechanism = os.environ.get(pidgroup.MECHANISM_ENV, "").strip().lower()
    if mechanism == "judgment":
        return True
    return warm_device != "cpu" and os.geteuid() == 0 and pidgroup.base() is None


def _kept_uids() -> set[int]:
    with kept.KEEPER._lock:
        return {w.exchange_uid for parked in kept.KEEPER.idle.values() for _, w in parked if w.exchange_uid}


def acquire() -> int | None:
    """A free uid, held for the caller (`release` it); None when every slot is taken (its processes then keep
    root's uid, unbounded as before, and say so)."""
    kept_uids = _kept_uids()
    with _LOCK:
        for i in range(nproc.SLOTS):
            slot = (_NEXT[0] + i) % nproc.SLOTS
            uid = nproc.exchange_uid(slot)
            if uid not in _HELD and uid not in kept_uids:
                _NEXT[0] = slot + 1
                _HELD[uid] = 1
                return uid
    return None


def hold(uid: int) -> None:
    with _LOCK:
        _HELD[uid] = _HELD.get(uid, 0) + 1


def release(uid: int) -> None:
    with _LOCK:
        left = _HELD.get(uid, 0) - 1
        if left > 0:
            _HELD[uid] = left
        else:
            _HELD.pop(uid, None)
