"""Which backend to use: cuda when a GPU is visible, else cpu. Decided without importing torch."""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

BACKENDS = ("cuda", "cpu")


def gpu_visible() -> bool:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    if "torch" in sys.modules:
        return bool(sys.modules["torch"].cuda.is_available())
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or Path("/dev/nvidia0").exists()


def resolve_backend(backend: str | None) -> str:
    backend = backend or os.environ.get("CUDA_AGENT_BACKEND") or ("cuda" if gpu_visible() else "cpu")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    return backend


def device_for(backend: str) -> str:
    """The torch device a backend's models run (and are timed) on."""
    return "cuda" if backend == "cuda" else "cpu"


# The GPU this thread's (or task's) judgments run on, as CUDA_VISIBLE_DEVICES names it: a judge process that
# judges in parallel (a trainer's step, the synthesis gate, a benchmark) spreads its judgments over a host's GPUs
# by pinning each one; the workers then see that GPU alone, as cuda:0, and its device lock is that GPU's.
_PINNED: ContextVar[str | None] = ContextVar("cuda_agent_pinned_gpu", default=None)


def visible_gpus() -> list[str]:
    """GPU ids as CUDA_VISIBLE_DEVICES names them, found without importing torch."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        ids = [x.strip() for x in env.split(",") if x.strip()]
        return [] if ids in ([], ["-1"]) else ids
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return [str(i) for i in range(len(list(proc.iterdir())))]
    return [str(i) for i in range(len(list(Path("/dev").glob("nvidia[0-9]*"))))]


@contextmanager
def on_gpu(gpu: str | None) -> Iterator[None]:
    """Run the judgments inside on one GPU of the host (None: as the process's environment says)."""
    token = _PINNED.set(gpu)
    try:
        yield
    finally:
        _PINNED.reset(token)


def pinned_gpu() -> str | None:
    return _PINNED.get()


def cuda_visible_devices() -> str | None:
    """What CUDA_VISIBLE_DEVICES the workers of this context get: the pinned GPU, else the process's own."""
    pinned = _PINNED.get()
    return pinned if pinned is not None else os.environ.get("CUDA_VISIBLE_DEVICES")


class GpuRing:
    """Hands the host's GPUs out round-robin to parallel judgments (`with ring.next(): judge(...)`).
    Empty on the CPU backend or where no GPU is visible: then every judgment runs as the environment says."""

    def __init__(self, backend: str, gpus: list[str] | None = None):
        self.gpus = list(gpus) if gpus is not None else (visible_gpus() if backend == "cuda" else [])
        self._next = itertools.cycle(self.gpus) if self.gpus else None
        self._lock = threading.Lock()

    def next(self):
        if self._next is None or len(self.gpus) < 2:  # one GPU: nothing to choose, the environment names it
            return on_gpu(None)
        with self._lock:
            return on_gpu(next(self._next))
