"""One device, one timing at a time: a readers-writer lock over the judge's processes on a host.

Timing a model while another process runs on the same device measures both. Under a trainer that judges a
step's responses in parallel (or several MCP servers, or a harness's concurrent episodes) that is not
just noise: the judge's integrity checks read the contention as the candidate's doing. Seen on an H100 with
twelve concurrent judgments of the same correct elementwise kernel: four failed `async_work` (the host
waited on the GPU well past the call's end event, because other processes' kernels held it).

So timing holds the device's lock exclusively, and every other judge phase that loads what a timing
measures holds it shared: verify's trials (the device), builds and torch.compile's compilation (the
host's cores: a small kernel's time is mostly launch latency on the host, and a timing beside eleven
nvcc builds failed the judge's wall-clock bound). Those run together, a timing runs alone. The locks
are flock(2) on files in one folder per host (`/tmp/cuda-agent-locks`, or `$CUDA_AGENT_LOCK_DIR`), not in
the judge's cache: two judges with caches of their own still load the same cores and GPUs, and two honest
kernels were failed `timing_unverified` while another judge with its own cache ran beside them. Every
user's judges share the folder (sticky, like /tmp) and its files (readable and writable by all: flock needs
an open file, and a judge of one user must wait for another's timing). flock(2) holds across processes and
dies with its holder. No candidate process can reach the folder (Landlock keeps /tmp out of its reads).
flock alone would let a stream of verifies starve a waiting timing, so a waiting timing announces itself
(a shared flock on `.writers`) and a reader enters only when none is announced. Every timing waiting at once
then runs back to back, once the device is clear: with eight judgments on an H100 a timing's wait for the
verifies in flight to finish (1-3 s) had been paid again for each timing, readers slipping in between them,
and was most of a judgment's queue. Readers that can pause (a verify between its trials: SharedHold.step_aside)
let a waiting timing go first instead of making it wait for their end. Waiting timings queue one at a time on
a turnstile (`.turnstile`), so that the one timing waiting on the lock itself is the next to run, and a timing
can step down to shared (Hold.share) without another timing taking the device in between.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from sandbox.confinement.reaper import REAPER

LOCK_DIR_ENV = "CUDA_AGENT_LOCK_DIR"


def lock_dir() -> Path:
    path = Path(os.environ.get(LOCK_DIR_ENV) or os.path.join(tempfile.gettempdir(), "cuda-agent-locks"))
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        try:
            os.chmod(path, 0o1777)  # every user's judges lock here; none may delete another's files
        except OSError:
            pass
    return path


def device_key(device: str) -> str:
    """The lock's name for a device as this process sees it: CUDA ordinals are relative to
    CUDA_VISIBLE_DEVICES, so the visible list is part of the key (two processes that see the same
    physical GPU through the same list share a lock; different lists are assumed to be different GPUs)."""
    if device.startswith("cuda"):
        from sandbox.backend import cuda_visible_devices

        visible = cuda_visible_devices() or "all"  # a judgment pinned to one GPU takes that GPU's lock
        ordinal = device.partition(":")[2] or "0"
        key = f"cuda-{visible}-{ordinal}"
    else:
        key = "cpu"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:120]


def _open_shared(path: Path) -> int:
    """The lock file, made readable and writable by every user on first use (the umask would narrow it)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except PermissionError:  # another user's file in a folder that is not shared: a read is enough to flock
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    finally:
        try:
            if path.stat().st_uid == os.getuid():
                os.chmod(path, 0o666)
        except OSError:
            pass


def _flock(stack: ExitStack, path: Path, mode: int, host_wide: bool = True):
    fh = stack.enter_context(os.fdopen(_open_shared(path), "rb") if host_wide else open(path, "a+"))
    fcntl.flock(fh, mode)
    stack.callback(fcntl.flock, fh, fcntl.LOCK_UN)
    return fh


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock(2) on `path` (created, with its folder), across threads and processes; released
    on exit or when its holder dies. The device lock below is two of these with a shared mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        _flock(stack, path, fcntl.LOCK_EX, host_wide=False)
        yield


class Hold:
    """An exclusive hold on a device (a timing) that can step down to a shared one without queueing again."""

    def __init__(self, queued_s: float, turnstile, lock):
        self.queued_s = queued_s
        self._turnstile, self._lock = turnstile, lock
        self.shared = False

    def share(self) -> None:
        """From now on beside verifies, never beside another timing. flock converts a lock by dropping and
        re-taking it, which is safe here: the turnstile is still held, so no other timing waits on the lock itself
        (readers only want it shared). Only then is the turnstile let go, so the next timing waits for this shared
        hold as for any verify's, and this judgment's remaining device work (the spot checks) does not queue
        behind every timing that arrived meanwhile."""
        if not self.shared:
            fcntl.flock(self._lock, fcntl.LOCK_SH)
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            self.shared = True


def _timing_waits(writers) -> bool:
    """Whether a timing has announced itself (holds `.writers` shared). A reader entering holds it exclusively
    for a moment too: read as a timing, which costs the asking reader one needless step aside at most."""
    try:
        fcntl.flock(writers, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(writers, fcntl.LOCK_UN)
    return False


def _enter_shared(writers, lock) -> None:
    """A reader's entry: once no timing is announced (a flock that waits for every announcement to end), the
    lock shared. A timing announced between the two waits for this reader, as for one that came before it."""
    fcntl.flock(writers, fcntl.LOCK_EX)
    fcntl.flock(writers, fcntl.LOCK_UN)
    fcntl.flock(lock, fcntl.LOCK_SH)


class SharedHold:
    """A shared hold on a device (a verify, a build, a profile's set-up) that can let a waiting timing go first."""

    def __init__(self, queued_s: float, writers, lock):
        self.queued_s = queued_s
        self.stepped_aside_s = 0.0
        self.steps_aside = 0
        self._writers, self._lock = writers, lock

    def step_aside(self, pause: Callable[[], contextlib.AbstractContextManager] | None = None) -> float:
        """At a point where the holder has nothing running on the device (between a verify's trials): if a timing
        waits, let the lock go until every timing waiting has run, then take it again. `pause`: entered
        meanwhile, to stop the holder's processes (a process with candidate code in it never runs beside
        another judgment's timing). The seconds spent aside (0.0 when no timing waited)."""
        if not _timing_waits(self._writers):
            return 0.0
        t = time.perf_counter()
        with pause() if pause is not None else contextlib.nullcontext():
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            _enter_shared(self._writers, self._lock)
        spent = time.perf_counter() - t
        self.stepped_aside_s += spent
        self.steps_aside += 1
        return spent


@contextmanager
def timing_hold(device: str, waiting: Callable[[], contextlib.AbstractContextManager] | None = None) -> Iterator[Hold]:
    """The device's lock held exclusively (a timing), as a Hold that may step down to shared (Hold.share).
    `waiting`: entered while the timing waits (a profile stops its candidate's processes: set up, they hold
    candidate code, and other judgments time meanwhile)."""
    base = lock_dir() / device_key(device)
    t0 = time.perf_counter()
    # this process's finished operations end their workers in the background (confinement/reaper.py): a timing
    # starts once they are gone, as it did when each operation waited for its own
    REAPER.drain(30.0)
    with ExitStack() as stack:
        with waiting() if waiting is not None else contextlib.nullcontext(), ExitStack() as announced:
            # from here until the lock is held, no reader enters
            _flock(announced, base.with_suffix(".writers"), fcntl.LOCK_SH)
            turnstile = _flock(stack, base.with_suffix(".turnstile"), fcntl.LOCK_EX)
            lock = _flock(stack, base.with_suffix(".lock"), fcntl.LOCK_EX)
        yield Hold(time.perf_counter() - t0, turnstile, lock)


@contextmanager
def shared_hold(device: str) -> Iterator[SharedHold]:
    """The device's lock held shared (work on the device that no timing may run beside), as a SharedHold."""
    base = lock_dir() / device_key(device)
    t0 = time.perf_counter()
    with ExitStack() as stack:
        writers = stack.enter_context(os.fdopen(_open_shared(base.with_suffix(".writers")), "rb"))
        lock = stack.enter_context(os.fdopen(_open_shared(base.with_suffix(".lock")), "rb"))
        stack.callback(fcntl.flock, lock, fcntl.LOCK_UN)
        _enter_shared(writers, lock)
        yield SharedHold(time.perf_counter() - t0, writers, lock)


@contextmanager
def device_lock(device: str, exclusive: bool) -> Iterator[float]:
    """Holds the device's lock (exclusive: timing; shared: other work on the device); yields the
    seconds spent waiting for it."""
    if exclusive:
        with timing_hold(device) as hold:
            yield hold.queued_s
        return
    with shared_hold(device) as hold:
        yield hold.queued_s
