"""Running ninja for a build: its process group, its timeout, and where on the host's cores it runs beside the judge's
timings (used by a workspace's build and by the infrastructure's, sandbox/build/infra_cache.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

from sandbox.backend import device_for
from sandbox.confinement.processes import kill_tree
from sandbox.timing import cores
from sandbox.timing.device_lock import device_lock

# Builds yield the cores to judging: with eight judgments at a time on an H100, sixteen compilers ran on the cores
# where the verifies' workers set up, and a verify with its workers ready took 6-17 s against 1.6-2.1 s alone. A
# verify or a profile is nearer its reward than a build, and mostly waits on the device; at nice 10 the scheduler
# gives a compiler about a tenth of a contested core, and all of an idle one.
BUILD_NICE = 10
def _ninja() -> str:
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships the binary

        return os.path.join(ninja.BIN_DIR, "ninja")
    except ImportError as e:
        raise RuntimeError("ninja is not installed (pip install ninja)") from e


def build_placement(backend: str) -> tuple[set[int] | None, contextlib.AbstractContextManager]:
    """Where a build runs beside the judge's timings: (the cores it may use, None for any; the lock it holds)."""
    cpus = cores.build_cores() if backend == "cuda" else None
    if cpus is not None:
        return cpus, contextlib.nullcontext()
    return None, device_lock(device_for(backend), exclusive=False)


def _run_ninja(build_dir: Path, log_path: Path, timeout_s: float, jobs: int | None,
               env: dict[str, str] | None = None, cpus: set[int] | None = None) -> tuple[int | None, str]:
    """Run ninja in its own process group; kill the whole group on timeout. rc None = timed out. `cpus`: the
    cores ninja and every compiler it starts may run on (inherited across fork and exec)."""
    cmd = [_ninja(), "-C", str(build_dir)]
    if jobs:
        cmd += ["-j", str(jobs)]
    elif cpus:
        cmd += ["-j", str(len(cpus) + 2)]  # ninja's default, counted on the cores it has
    env = {**(os.environ if env is None else env), "NINJA_STATUS": "[%f/%t] "}

    def place() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        with contextlib.suppress(OSError):
            os.nice(BUILD_NICE)

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, preexec_fn=place)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_tree(proc.pid)
            proc.wait()
    data = log_path.read_bytes()
    return rc, data.decode(errors="replace")
