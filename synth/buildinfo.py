"""BUILD/build.json: the parameters that define a build's set, and a record of every invocation.

A build is made over several invocations (device calls of ten minutes, sessions, machines): each one
carries the folder in and out and runs the same command with --resume. What it must not do is continue
a build under other parameters, which would mix two sets in one folder without a trace; so the first
invocation records them and every resumed one is held to them. `--count` may grow (composition is
deterministic in the seed, and a larger count only adds candidates after the first ones). The record of
runs says which machine, device and torch made which part, for the report and the closing note.

Nothing here is a path or a machine's cache: the folder is read the same wherever it is copied to.
"""

from __future__ import annotations

import json
import platform
import subprocess
import time
from importlib import metadata
from pathlib import Path

from synth.manifest import StageError

BUILD_INFO = "build.json"
# the parameters that decide which tasks are made and kept; jobs, GPUs and time limits do not
FIXED = ("backend", "seed", "max_ops", "band_ms", "threshold", "compile", "transformers", "composer",
         "eval_fraction")


def read_info(build: Path) -> dict | None:
    path = build / BUILD_INFO
    return json.loads(path.read_text()) if path.is_file() else None


def _write(build: Path, info: dict) -> None:
    tmp = build / f".{BUILD_INFO}.tmp"
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(build / BUILD_INFO)


def open_build(build: Path, params: dict, resume: bool) -> dict:
    """Record (first invocation) or check (resumed) the build's parameters; returns the info."""
    params = json.loads(json.dumps(params))  # tuples as lists, as they read back
    info = read_info(build)
    if info is not None and not resume:
        raise StageError(f"{build} already holds a build ({BUILD_INFO}): pass --resume to continue it, "
                         "or choose an empty folder")
    if info is not None:
        old = info.get("params", {})
        diff = [k for k in FIXED if k in old and old[k] != params.get(k)]
        if diff:
            was = ", ".join(f"{k}={old[k]!r} (now {params.get(k)!r})" for k in diff)
            raise StageError(f"{build} was built with {was}: resume it with the same values, or build into a "
                             "new folder")
        params["count"] = max(int(params.get("count") or 0), int(old.get("count") or 0))
    info = {"version": 1, "params": params, "runs": (info or {}).get("runs", [])}
    build.mkdir(parents=True, exist_ok=True)
    _write(build, info)
    return info


def _device(backend: str) -> str:
    if backend != "cuda":
        return platform.processor() or platform.machine()
    try:  # nvidia-smi, not torch: the pipeline's process never initialises CUDA
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout
        names = [n.strip() for n in out.splitlines() if n.strip()]
        return f"{len(names)} x {names[0]}" if names else "unknown GPU"
    except (OSError, subprocess.SubprocessError):
        return "unknown GPU"


def record_run(build: Path, backend: str, started: float, seconds: float, complete: bool,
               decided: dict[str, int]) -> None:
    """Append one invocation: when, where, what it decided per stage, and whether the build was complete after."""
    info = read_info(build) or {"version": 1, "params": {}, "runs": []}
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    info["runs"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                         "seconds": round(seconds, 1), "host": platform.node(), "device": _device(backend),
                         "torch": torch_version, "decided": decided, "complete": complete})
    _write(build, info)
