"""Running ninja for a build: its process group, its timeout, and where on the host's cores it runs beside the judge's
timings (used by a workspace's build and by the infrastructure's, sandbox/build/infra_cache.py)."""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import subprocess
from pathlib import Path

from sandbox.backend import device_for
from sandbox.build.jail import BuildLimits
from sandbox.confinement import pidgroup
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


def _wait(proc: subprocess.Popen, timeout_s: float) -> tuple[int | None, float | None]:
    """proc's exit code (None: still running after timeout_s) and the CPU seconds it and every process it waited for
    used (ninja waits for each compile it starts, so: the whole build's), or None where they cannot be read."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            return proc.wait(timeout=timeout_s), None
        except subprocess.TimeoutExpired:
            return None, None
    try:
        poller = select.poll()  # not select(): a judge with many workers open holds descriptors past FD_SETSIZE
        poller.register(fd, select.POLLIN)
        ready = poller.poll(max(0, int(timeout_s * 1000)))
    finally:
        os.close(fd)
    if not ready:
        return None, None
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage.ru_utime + usage.ru_stime


def _run_ninja(build_dir: Path, log_path: Path, timeout_s: float, jobs: int | None,
               env: dict[str, str] | None = None, cpus: set[int] | None = None,
               usage: dict | None = None) -> tuple[int | None, str]:
    """Run ninja in its own process group; kill the whole group on timeout. rc None = timed out. `cpus`: the
    cores ninja and every compiler it starts may run on (inherited across fork and exec). `usage`: gets "cpu_s",
    the CPU seconds of the build's processes (added to what it holds), where they can be read. ninja and what it
    starts share a cgroup pids group of BuildLimits.tasks where the host offers one (sandbox.confinement.pidgroup);
    each tool's own limits are the jail's (sandbox/build/jail.py)."""
    cmd = [_ninja(), "-C", str(build_dir)]
    if jobs:
        cmd += ["-j", str(jobs)]
    elif cpus:
        cmd += ["-j", str(len(cpus) + 2)]  # ninja's default, counted on the cores it has
    env = {**(os.environ if env is None else env), "NINJA_STATUS": "[%f/%t] "}
    tasks = BuildLimits.from_env().tasks

    def place() -> None:
        pidgroup.join(tasks, "b")  # in the child, before ninja starts anything: one group for the whole build
        if cpus:
            os.sched_setaffinity(0, cpus)
        with contextlib.suppress(OSError):
            os.nice(BUILD_NICE)
        # no RLIMIT_NPROC under a uid of its own here (sandbox.confinement.nproc): ninja runs each step through
        # /bin/sh, which sets its effective uid to a real one that differs, and the compilers could then read none
        # of root's folders; a build runs no client code, and ninja's -j bounds its tools

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, preexec_fn=place)
        try:
            rc, cpu_s = _wait(proc, timeout_s)
            if usage is not None and cpu_s is not None:
                usage["cpu_s"] = usage.get("cpu_s", 0.0) + cpu_s
        finally:
            kill_tree(proc.pid)
            proc.wait()
    data = log_path.read_bytes()
    return rc, data.decode(errors="replace")
