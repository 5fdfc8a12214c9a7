"""Which backend to use: cuda when a GPU is visible, else cpu. Decided without importing torch."""

from __future__ import annotations

import os
import sys
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
