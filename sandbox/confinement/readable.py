"""What a confined process may read, in the second Landlock stage: the allow-lists, one place.

Every process that runs code a client wrote (a candidate's extension and model_new.py, a task's
reference in the check, verify, eager, baseline, probe and trace roles, and the compilers of a build)
reads only what it needs: the system's libraries and tools, the Python installation and the libraries
it mapped, the sandbox package, and its own files. Broad system roots are narrowed where they hold
another process's secrets or another client's files:

- /proc: only the process's own entries and a few machine-wide files. Another process's `cmdline`
  (the MCP server's, with a `--token` in it) is world-readable, unlike its `environ`, which Landlock's
  ptrace rule already keeps out of reach;
- /etc: only what the dynamic loader, libc's user lookups and the C/C++/CUDA toolchains read
  (no /etc/shadow for a judge running as root, no host keys or credentials);
- /dev: the device files it uses, and /dev/shm without listing it: the judge's session directories
  there (logs, a task's source being checked) have unguessable names, and CUDA IPC's files are opened
  by name.

Standard library only: imported by worker processes before torch, and by the build's launcher.
"""

from __future__ import annotations

import os
import sys

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
READ = EXECUTE | READ_FILE | READ_DIR
WRITE = READ | WRITE_FILE | TRUNCATE | REMOVE_DIR | REMOVE_FILE | MAKE_DIR | MAKE_REG | REFER
DEVICE = READ_FILE | WRITE_FILE | IOCTL_DEV
# files in /dev/shm by name (CUDA IPC reference counts, POSIX semaphores), without listing the folder
SHM_FILES = READ_FILE | WRITE_FILE | TRUNCATE | MAKE_REG | REMOVE_FILE

SYSTEM_READ_ROOTS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/sys",
                     "/run/nvidia-persistenced")
ETC_READ = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "ld.so.preload", "passwd", "group", "nsswitch.conf",
            "localtime", "timezone", "alternatives", "os-release", "lsb-release", "debian_version", "hosts",
            "host.conf", "resolv.conf", "gai.conf", "mime.types", "nvidia", "OpenCL", "vulkan", "glvnd",
            "cuda", "gcc", "environment")
PROC_READ = ("cpuinfo", "meminfo", "stat", "sys", "driver", "filesystems", "version", "loadavg", "uptime",
             "mounts", "self", "thread-self")
DEVICE_FILES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def real(p: str) -> str:
    return os.path.realpath(p)


def contains(root: str, path: str) -> bool:
    root, path = real(root), real(path)
    return path == root or path.startswith(root.rstrip("/") + "/")


def judge_cache_dir() -> str:
    env = os.environ.get("CUDA_AGENT_CACHE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cuda-agent")


def device_rules(devices: tuple[str, ...] | None = None) -> list[tuple[str, int]]:
    """The device files of a process that may run CUDA, or, given `devices`, only those (a build's tools get
    /dev/null: a compiler told to `#include "/dev/zero"` would read it until the host's memory ran out)."""
    if devices is not None:
        return [(p, DEVICE) for p in devices]
    # CUDA's initialisation opens a file of its own /proc entry for writing with O_TRUNC: without write and
    # truncate rights beneath /proc/self, cudaGetDeviceCount fails with error 304 (measured on the H100/H200
    # machine: read+write alone is not enough). The rule reaches only this process's own entries.
    rules = [(p, DEVICE) for p in DEVICE_FILES] + [("/proc/self", READ | WRITE_FILE | TRUNCATE)]
    try:
        rules += [(os.path.join("/dev", n), DEVICE) for n in os.listdir("/dev") if n.startswith("nvidia")]
    except OSError:
        pass
    return rules


def python_roots() -> list[str]:
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(sys.executable)}
    roots.update(p for p in sys.path if os.path.isdir(p) and ("site-packages" in p or "dist-packages" in p))
    roots.update(p for p in sys.path if p.startswith(("/usr", sys.base_prefix)) and os.path.isdir(p))
    for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") + [os.environ.get("CUDA_HOME", ""),
                                                                  os.environ.get("CUDA_PATH", "")]:
        if p:
            roots.add(p)
    try:  # directories of every library mapped so far (torch, CUDA, the interpreter)
        with open("/proc/self/maps") as fh:
            for line in fh:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith("/") and not parts[5].startswith(("/dev/", "/proc/")):
                    path = parts[5].strip()
                    if os.path.isfile(path):
                        roots.add(os.path.dirname(path))
    except OSError:
        pass
    return sorted(roots)


def system_rules(devices: tuple[str, ...] | None = None) -> list[tuple[str, int]]:
    """The narrowed system roots: libraries and tools whole; /etc, /proc and /dev by entry (`device_rules`)."""
    rules = [(r, READ) for r in SYSTEM_READ_ROOTS]
    rules += [(os.path.join("/etc", n), READ) for n in ETC_READ]
    rules += [(os.path.join("/proc", n), READ) for n in PROC_READ]
    return rules + device_rules(devices)


def package_dir() -> str:
    from sandbox import __file__ as pkg_init

    return os.path.dirname(pkg_init)


def read_rules(files: list[str], dirs: list[str], denied: list[str], extra_roots: list[str] = (),
               devices: tuple[str, ...] | None = None) -> tuple[list[tuple[str, int]], list[str]]:
    """System, Python and package roots plus `files` and `dirs`, minus any root that would expose a denied
    path (the judge's cache always). `devices`: the device files, where not those of `device_rules`. Returns
    (rules, notes): a note for each root dropped."""
    notes: list[str] = []
    rules: list[tuple[str, int]] = []
    denied = [judge_cache_dir(), *denied]
    for path, access in system_rules(devices) + [(r, READ) for r in [*python_roots(), package_dir(), *extra_roots]]:
        if contains(judge_cache_dir(), path):  # a library mapped from the judge's cache (compiled code)
            notes.append(f"{path} stays unreadable (it lies in the judge's cache)")
            continue
        bad = [d for d in denied if contains(path, d)]
        if bad:
            notes.append(f"{path} stays unreadable (it holds {bad[0]})")
            continue
        rules.append((path, access))
    rules += [(f, READ_FILE) for f in files] + [(d, READ) for d in dirs]
    return rules, notes


def candidate_rules(scratch: str, shm_dir: str, files: list[str], dirs: list[str], denied: list[str],
                    cuda: bool) -> tuple[list[tuple[str, int]], list[str]]:
    """A candidate's process: reads as above, writes only scratch and the session's exchange directory."""
    rules, notes = read_rules(files, dirs, denied)
    rules += [(scratch, WRITE), (shm_dir, WRITE)]
    if cuda and os.path.isdir("/dev/shm"):
        # CUDA IPC: torch keeps each exported block's reference count in a file it creates here
        rules.append(("/dev/shm", SHM_FILES))
    return rules, notes


def compiler_roots() -> list[str]:
    """The installations of the C and C++ compilers torch.compile's Triton and Inductor start, wherever the
    machine keeps them (the GPU hosts' gcc is /opt/gcc/bin/gcc, outside the system roots): each one's prefix, the
    folder above its bin/, so that its own programs (cc1, as, ld) and headers come with it."""
    import shutil

    roots = set()
    for name in (os.environ.get("CC", ""), os.environ.get("CXX", ""), "cc", "gcc", "c++", "g++", "clang"):
        path = shutil.which(name) if name else None
        if path:
            roots.add(os.path.dirname(os.path.dirname(real(path))))
    return sorted(r for r in roots if r not in ("/", ""))


def task_rules(scratch: str, exchange: str | None, files: list[str], denied: list[str],
               compiles: bool = False) -> tuple[list[tuple[str, int]], list[str]]:
    """A process that runs a task's reference (and never a candidate): reads as above plus the task files (and
    the compilers, when torch.compile may start them); writes its scratch and files by name in the exchange area
    (the session's outputs, CUDA IPC, torch.compile's worker semaphores)."""
    rules, notes = read_rules(files, [], denied, compiler_roots() if compiles else [])
    rules += [(scratch, WRITE)]
    if exchange and os.path.isdir(exchange):
        rules.append((exchange, SHM_FILES | READ_FILE))
    return rules, notes


def workspace_denials(paths: list[str]) -> list[str]:
    """What a task's or a candidate's files must not open up: the folder that holds its workspace (other
    workspaces) and the judge's state inside it."""
    out = []
    for p in paths:
        d = os.path.dirname(real(p))
        if os.path.basename(d) == ".cuda_agent":
            d = os.path.dirname(d)
        out += [os.path.join(d, ".cuda_agent"), os.path.dirname(d)]
    return out
