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
are flock(2) on files in the judge's cache, so they hold across processes and die with their holder.
flock alone would let a stream of verifies starve a waiting timing; a turnstile gives the writer
priority: a reader passes through it before taking its shared lock, and a writer holds it while it
waits and times, so readers that arrive meanwhile queue behind the writer.
"""

from __future__ import annotations

import fcntl
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path


def lock_dir() -> Path:
    from sandbox.config import cache_dir

    path = cache_dir() / "locks"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
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


def _flock(stack: ExitStack, path: Path, mode: int) -> None:
    fh = stack.enter_context(open(path, "a+"))
    fcntl.flock(fh, mode)
    stack.callback(fcntl.flock, fh, fcntl.LOCK_UN)


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock(2) on `path` (created, with its folder), across threads and processes; released
    on exit or when its holder dies. The device lock below is two of these with a shared mode."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        _flock(stack, path, fcntl.LOCK_EX)
        yield


@contextmanager
def device_lock(device: str, exclusive: bool) -> Iterator[float]:
    """Holds the device's lock (exclusive: timing; shared: other work on the device); yields the
    seconds spent waiting for it."""
    base = lock_dir() / device_key(device)
    t0 = time.perf_counter()
    with ExitStack() as stack:
        if exclusive:
            _flock(stack, base.with_suffix(".turnstile"), fcntl.LOCK_EX)
            _flock(stack, base.with_suffix(".lock"), fcntl.LOCK_EX)
        else:
            with ExitStack() as gate:  # through the turnstile, not holding it
                _flock(gate, base.with_suffix(".turnstile"), fcntl.LOCK_EX)
                _flock(stack, base.with_suffix(".lock"), fcntl.LOCK_SH)
        yield time.perf_counter() - t0
