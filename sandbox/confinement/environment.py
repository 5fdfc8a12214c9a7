"""What a worker process is given: a scrubbed environment, where outputs pass by file, the judge's compile cache.

Pure functions of this process's settings, kept apart from the worker and its pool (processes.py)."""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from sandbox import PACKAGE_ROOT
from sandbox.backend import cuda_visible_devices
from sandbox.config import cache_dir
from sandbox.confinement import filesystem, pidgroup

_ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "CUDA_VISIBLE_DEVICES", "CUDA_HOME", "CUDA_PATH",
             "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
             "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "CC", "CXX", "XDG_CACHE_HOME")
_ENV_PREFIXES = ("TORCH", "TORCHINDUCTOR_", "TRITON_", "PYTORCH_NVML")
# only the sandbox's own non-secret settings; tokens such as CUDA_AGENT_MCP_TOKEN stay behind
_ENV_KEEP_OWN = ("CUDA_AGENT_CACHE", "CUDA_AGENT_KERNELBENCH", "CUDA_AGENT_BACKEND", "CUDA_AGENT_CONFINE",
                 "CUDA_AGENT_PIDS")


# the hardware work queues each worker's CUDA context gets (CUDA_DEVICE_MAX_CONNECTIONS; 0: CUDA's default, 8). Two:
# a context is what every judgment creates, under the device's shared lock, and on an H200 under eight judgments
# one was created in 0.16-0.17 s with two queues against 0.57-0.71 s with eight (docs/history.md, fifteenth
# round). A candidate's third concurrent stream shares a queue with one of the first two: never faster than it is
DEVICE_CONNECTIONS_ENV, _DEVICE_CONNECTIONS = "CUDA_AGENT_DEVICE_CONNECTIONS", 2


def count_setting(name: str, default: int) -> int:
    """A count the user sets in environment variable `name` (unset or blank: `default`; not a number: 0, off)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return max(0, int(raw))
    except ValueError:
        return 0


def package_root() -> str:
    return PACKAGE_ROOT


def worker_env() -> dict[str, str]:
    """A scrubbed environment: no API keys or tokens reach the candidate's process."""
    env = {k: v for k, v in os.environ.items()
           if k in _ENV_KEEP or k in _ENV_KEEP_OWN or k.startswith(_ENV_PREFIXES)}
    paths = [package_root()] + [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # named explicitly: a confined worker points XDG_CACHE_HOME into its scratch, and must still know
    # which directory to keep unreadable
    env["CUDA_AGENT_CACHE"] = str(cache_dir())
    # IPC export of outputs needs the default caching allocator, not expandable segments
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    connections = count_setting(DEVICE_CONNECTIONS_ENV, _DEVICE_CONNECTIONS)
    if connections:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = str(connections)
    visible = cuda_visible_devices()  # a judgment pinned to one of the host's GPUs (sandbox.backend.on_gpu)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def shared_compile_cache() -> str:
    """The judge's persistent Inductor/Triton cache (made private to the user): only the baseline role
    compiles with it, and only where no candidate process can reach it (see sandbox.confinement.filesystem)."""
    path = filesystem.compile_cache_dir()
    os.makedirs(path, mode=0o700, exist_ok=True)
    for part in filesystem.COMPILE_CACHE_PARTS:  # TMPDIR must exist, or tempfile falls back to /tmp
        os.makedirs(os.path.join(path, part), mode=0o700, exist_ok=True)
    return path


def exchange_base() -> str:
    """Where exchange directories are made: in RAM where possible."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


_OWNER = ".owner"  # made once its folder's lock is held: a folder without it is being made, and left alone
_PROCESS: dict = {"pid": None, "dir": None, "fd": -1}
_PROCESS_LOCK = threading.Lock()


def sweep(base: str) -> list[str]:
    """Remove the folders in `base` whose judging process is gone (killed, or ended by os._exit past its exit
    handlers): each holds a lock on its folder for its life, so a lock this process can take is an owner's that
    died. Folders of live processes and of older versions (no owner mark) are left as they are."""
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith("cuda-agent-")]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        if not os.path.isfile(os.path.join(path, _OWNER)):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
        removed.append(path)
    return removed


def process_folder() -> str:
    """This process's folder in the exchange area, under which every folder of its judgments is made (sessions,
    pooled and kept workers' scratch): made at first use, after the leftovers of dead processes are swept, and
    removed when the process exits (`remove_process_folder`), or by the next process's sweep."""
    with _PROCESS_LOCK:
        if _PROCESS["pid"] == os.getpid() and os.path.isdir(_PROCESS["dir"]):
            return _PROCESS["dir"]
        base = exchange_base()
        sweep(base)
        # what dead workers' children left running in their pids groups (a judge that died by SIGKILL)
        pidgroup.sweep()
        path = tempfile.mkdtemp(prefix=f"cuda-agent-{os.getpid()}-", dir=base)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX)
        open(os.path.join(path, _OWNER), "w").close()
        _PROCESS.update(pid=os.getpid(), dir=path, fd=fd)
        return path


def current_process_folder() -> str | None:
    """This process's folder, if made, read without the lock (a signal handler may interrupt its holder)."""
    return _PROCESS["dir"] if _PROCESS["pid"] == os.getpid() else None


def remove_process_folder() -> None:
    """Everything this process's judgments left in the exchange area, gone now (its workers are dead or dying)."""
    with _PROCESS_LOCK:
        if _PROCESS["pid"] != os.getpid() or not _PROCESS["dir"]:
            return
        shutil.rmtree(_PROCESS["dir"], ignore_errors=True)
        os.close(_PROCESS["fd"])
        _PROCESS.update(pid=None, dir=None, fd=-1)


atexit.register(remove_process_folder)  # registered at import, so it runs after the reaper's exit handler


def handoff_dir() -> Path:
    """A folder for files the judge writes for a worker to read by path (a task's source, a shim): outside the
    exchange area, since a worker whose /dev/shm is its own sees nothing of the host's there."""
    base = tempfile.gettempdir()
    if os.path.realpath(base).startswith("/dev/shm"):
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="cuda-agent-handoff-", dir=base))


def exchange_dir(prefix: str = "cuda-agent-") -> Path:
    """A private directory for a judgment's files (outputs passed by file, logs, workers' scratch)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=process_folder()))
