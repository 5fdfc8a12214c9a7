"""Find and kill a process's whole tree, including children that started their own sessions.

The sandbox runs ninja and its workers with start_new_session=True, so killing one process group
misses them. We walk /proc by parent id instead. The helper that runs a sandbox operation makes
itself a child subreaper, so orphans stay inside its tree and a walk from it finds everything.
"""

from __future__ import annotations

import ctypes
import math
import os
import select
import signal
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to us rather than to init (Linux)."""
    return _prctl(_PR_SET_CHILD_SUBREAPER, 1)


def is_subreaper() -> bool:
    """Whether this process collects its orphaned descendants (become_subreaper): whatever it starts, however
    detached, stays in its tree, and dies with it where the tree is killed (an MCP helper's end)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        return libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value != 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Receive `sig` when the process that started us dies (Linux)."""
    return _prctl(_PR_SET_PDEATHSIG, int(sig))


def die_with(parent: int) -> bool:
    """SIGKILL this process when the thread that started it ends (PR_SET_PDEATHSIG; kept across exec), armed only
    while `parent` is still its parent: False where it is not (it died before the signal was armed), and the
    caller should exit. SIGKILL, since this process may be stopped then (sandbox/confinement/orphans.py)."""
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    return os.getppid() == parent


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, state) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    # the command name is in parentheses and may itself contain spaces and parentheses
    fields = data[data.rfind(b")") + 2:].split()
    return int(fields[1]), fields[0].decode()


def _parents() -> dict[int, int]:
    out: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st[0]
    return out


def descendants(root: int) -> list[int]:
    """Every live process below `root`, parents before children."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    out: list[int] = []
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def ancestors(pid: int) -> list[int]:
    """The processes above `pid`, its parent first."""
    out: list[int] = []
    st = _stat(pid)
    while st is not None and st[0] > 0 and st[0] not in out:
        out.append(st[0])
        st = _stat(st[0])
    return out


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[1] not in ("Z", "X")


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@contextmanager
def stopped(roots: Iterable[int], spent: dict | None = None) -> Iterator[None]:
    """SIGSTOP each root's whole process tree while inside, SIGCONT on the way out: nothing it left running (a
    thread, a pool spinning down) runs meanwhile. `spent["pauses"]` gathers the seconds the stopping and the
    resuming took (a walk of /proc each time)."""
    t = time.perf_counter()
    pids = [p for root in roots for p in (root, *descendants(root))]
    _signal(pids, signal.SIGSTOP)
    if spent is not None:
        spent["pauses"] = spent.get("pauses", 0.0) + time.perf_counter() - t
    try:
        yield
    finally:
        t = time.perf_counter()
        _signal(pids, signal.SIGCONT)
        if spent is not None:
            spent["pauses"] = spent.get("pauses", 0.0) + time.perf_counter() - t


def wait_stopped(roots: Iterable[int], timeout: float = 1.0) -> bool:
    """Wait until every thread of each root's process tree has taken its SIGSTOP (state T; a process gone counts as
    stopped). A stop is delivered when the thread next runs, so right after kill() a process may still run for a
    moment; whoever must know that nothing runs any more (a lock let go after it) waits here. False on timeout (a
    thread inside an uninterruptible call stops when it returns)."""
    deadline = time.monotonic() + timeout
    pids = [p for root in roots for p in (root, *descendants(root))]
    while True:
        running = False
        for pid in pids:
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                st = _stat(int(tid)) if tid.isdigit() else None
                if st is not None and st[1] not in ("T", "t", "Z", "X"):
                    running = True
                    break
            if running:
                break
        if not running:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.0005)


def kill_tree(root: int, *, include_root: bool = True) -> list[int]:
    """SIGKILL `root` (optionally) and everything below it; return the pids signalled.

    Everything is stopped first, so no process can fork or re-parent while we look; then each
    process and each process group found is killed, except a group led by one of the root's ancestors: a
    worker forked from a template is in the template's group until its setsid(), and killing it that early
    (a session ended right after its spawn) must not take the template, or the daemon, down with it.
    """
    spared = set(ancestors(root))
    if include_root:
        _signal([root], signal.SIGSTOP)
    found: list[int] = []
    for _ in range(20):
        new = [p for p in descendants(root) if p not in found]
        if not new:
            break
        _signal(new, signal.SIGSTOP)
        found.extend(new)
    groups = set()
    for pid in found + ([root] if include_root else []):
        try:
            groups.add(os.getpgid(pid))
        except (ProcessLookupError, PermissionError):
            pass
    own_group = os.getpgrp()
    for pgid in groups:
        if pgid != own_group and pgid not in spared and (include_root or pgid != os.getpgid(root)):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    _signal(found, signal.SIGKILL)
    if include_root:
        _signal([root], signal.SIGKILL)
    return found


def kill_own_tree(timeout_s: float = 3.0) -> None:
    """Kill everything below this process and wait for it, so no zombie outlives us either.

    As a subreaper we inherit the orphans (a compiler whose ninja died), so waiting for any child
    collects them all.
    """
    kill_tree(os.getpid(), include_root=False)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def readable(items: list, timeout: float | None) -> list:
    """Those of `items` (descriptors, or objects with fileno(): sockets) with data, an end or an exit (a pidfd) to
    read, waiting up to `timeout` seconds (None: no limit). poll, not select: select cannot watch a descriptor
    numbered 1024 or above, which a long-lived judge process reaches (a synth build's gate failed every task after
    ~400 with "filedescriptor out of range in select()")."""
    poller, by_fd = select.poll(), {}
    for item in items:
        fd = item if isinstance(item, int) else item.fileno()
        by_fd[fd] = item
        poller.register(fd, select.POLLIN | select.POLLPRI)
    ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [by_fd[fd] for fd, _ in poller.poll(ms)]
