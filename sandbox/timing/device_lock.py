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
flock alone would let a stream of verifies starve a waiting timing; a turnstile gives the writer
priority: a reader passes through it before taking its shared lock, and a writer holds it while it
waits and times, so readers that arrive meanwhile queue behind the writer. Readers that were already in
are waited for, not stopped: timings that waited together and then ran back to back, with every verify stepping
aside between its trials for them, made eight judgments on an H200 slower (24.4 against 29.4 a minute), the
stalled verifies losing more than the timings gained (3daac8d:bench/results/judge_vi_round11_2026-11-27/).
Nor are readers limited in number: with at most two or three shared holders at once (reader slots, so that a
waiting timing would wait for fewer), eight judgments on an H200 ran 17.9 and 18.0 a minute against 24.5 without
a limit, the verifies queueing 5.6 s for a slot (their pools were also started ahead, which the unlimited run's
was not: 3daac8d:bench/results/judge_vi_readers_2026-11-28/). Nor do readers hold back while a timing is queued, so that
timings queued together run back to back: on an H200, eight judgments ran 48.8 and 44.9 a minute so against 48.1 and
45.8 without (3daac8d:bench/results/judge_vi_judged_2026-11-28/, call 3).
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path

from sandbox.confinement.reaper import REAPER
from sandbox.confinement.warm_pool import gate_device_opens

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

    def __init__(self, queued_s: float, turnstile, lock, drain_s: float = 0.0):
        self.queued_s, self.drain_s = queued_s, drain_s
        self._turnstile, self._lock = turnstile, lock
        self.shared = False

    def share(self) -> None:
        """From now on beside verifies, never beside another timing. flock converts a lock by dropping and
        re-taking it, which is safe here: the turnstile is still held, and every other holder, reader or
        writer, passes through it before it takes the lock. Only then is the turnstile let go, so a timing
        waiting behind this one now waits for this shared hold as for any verify's, and this judgment's
        remaining device work (the spot checks) does not queue behind every timing that arrived meanwhile."""
        if not self.shared:
            fcntl.flock(self._lock, fcntl.LOCK_SH)
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            self.shared = True


@contextmanager
def timing_hold(device: str, waiting: Callable[[], AbstractContextManager] | None = None) -> Iterator[Hold]:
    """The device's lock held exclusively (a timing), as a Hold that may step down to shared (Hold.share).
    `waiting`: entered while the timing waits (a profile stops its candidate's processes: set up, they hold
    candidate code, and other judgments time meanwhile)."""
    base = lock_dir() / device_key(device)
    t0 = time.perf_counter()
    # this process's finished operations end their workers in the background (confinement/reaper.py): a timing
    # starts once they are gone, as it did when each operation waited for its own
    REAPER.drain(30.0)
    drained = time.perf_counter() - t0
    with ExitStack() as stack:
        with waiting() if waiting is not None else nullcontext():
            turnstile = _flock(stack, base.with_suffix(".turnstile"), fcntl.LOCK_EX)
            lock = _flock(stack, base.with_suffix(".lock"), fcntl.LOCK_EX)
        yield Hold(time.perf_counter() - t0, turnstile, lock, drained)


@contextmanager
def device_lock(device: str, exclusive: bool) -> Iterator[float]:
    """Holds the device's lock (exclusive: timing; shared: other work on the device); yields the
    seconds spent waiting for it."""
    if exclusive:
        with timing_hold(device) as hold:
            yield hold.queued_s
        return
    base = lock_dir() / device_key(device)
    t0 = time.perf_counter()
    with ExitStack() as stack:
        with ExitStack() as gate:  # through the turnstile, not holding it
            _flock(gate, base.with_suffix(".turnstile"), fcntl.LOCK_EX)
            _flock(stack, base.with_suffix(".lock"), fcntl.LOCK_SH)
        yield time.perf_counter() - t0


# a pool's workers create their CUDA contexts under the shared lock, a few at a time (confinement/warm_pool.py)
gate_device_opens(lambda device: device_lock(device, exclusive=False))
