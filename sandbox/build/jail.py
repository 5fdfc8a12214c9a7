"""The compilers and the linker of a workspace's build run confined.

A build reads what a client wrote: an `#include` of an absolute path, or an assembler `.incbin`, makes
the compiler open any file the judge's user can read, and its diagnostics and the build log then carry
that file's text back to the client. So every compile and link step of a workspace runs under a
Landlock domain (`python -I jail.py -- COMMAND...`, run by path, or `objcache.py`, which confines the
compiler it starts the same way): it reads the system's tools and libraries (sandbox/confinement/
readable.py: /etc, /proc and /dev narrowed), the Python installation (torch's headers and libraries),
the toolchain's folders and the workspace; it writes only the workspace's build folder; no TCP, no
signals out of the domain, no ptrace or /proc/PID/environ of another process. Where the kernel allows
it the compiler also gets a network namespace of its own.

Each tool also runs under resource limits that hold as root (`BuildLimits`): its memory (RLIMIT_DATA: the
private writable memory it maps; an `#include` of an endless or huge file must not take the host's), the size of
each file it writes (RLIMIT_FSIZE, with SIGXFSZ ignored so that the tool reports "File too large" instead of
dying unexplained: an 80-byte source with `char blob[128 << 20] = {1};` must not make a 128 MiB object), and of
the devices only /dev/null (no /dev/zero to read forever). ninja and every tool of one build share a cgroup
pids group where the host offers one (sandbox/build/ninja_run.py, sandbox/confinement/pidgroup.py).

The rules come from the judge in `CUDA_AGENT_BUILD_JAIL` (JSON: {"read": [...], "write": [...], "limits": {...}}), which
`sandbox.build.compile` sets for a workspace's build only: the infrastructure builds compile the
project's own sources. Without the variable, with `CUDA_AGENT_CONFINE` other than `on`, or on a kernel
without Landlock, the command runs unconfined, as before (docs/mcp.md says what that leaves open).
Standard library only, like objcache.py: tens of milliseconds per compile step.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import sys
from dataclasses import asdict, dataclass, fields

JAIL_ENV = "CUDA_AGENT_BUILD_JAIL"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# what a build's tools need of the judge's environment; anything else (API keys, tokens) stays behind
_ENV_KEEP = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH", "CC",
             "CXX", "CUDA_AGENT_CACHE", "CUDA_AGENT_CONFINE", "CUDA_AGENT_OBJECT_CACHE_MB")


_MIB = 1 << 20
# what a compiler may open of /dev: nvcc, g++, the assembler and the linker need no other device
BUILD_DEVICES = ("/dev/null",)


@dataclass(frozen=True)
class BuildLimits:
    """Per tool of a build (each compiler, assembler, linker process), 0 turning one off. Honest builds measured
    far below: g++ with torch's headers peaks at about 0.6 GiB, an extension is a few hundred KiB to a few MiB.
    Set from the judge's environment: CUDA_AGENT_BUILD_<FIELD> (`serve --build-memory-mb` and the others)."""

    memory_mb: int = -1  # RLIMIT_DATA of each tool; -1: a quarter of the host's memory, at most 8 GiB (nvcc's cicc
    # and ptxas on heavy templates take a few GiB; ninja runs several tools at once)
    file_mb: int = 64  # RLIMIT_FSIZE: the largest file a tool may write (objects, the extension)
    tasks: int = 4096  # threads and processes of the whole build, ninja's included (its cgroup pids group)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> BuildLimits:
        env = os.environ if env is None else env
        values = {}
        for f in fields(cls):
            raw = env.get(f"CUDA_AGENT_BUILD_{f.name.upper()}")
            if raw is not None:
                try:
                    values[f.name] = max(0, int(raw))
                except ValueError:
                    raise ValueError(f"CUDA_AGENT_BUILD_{f.name.upper()} must be a whole number, not {raw!r}") from None
        lim = cls(**values)
        if lim.memory_mb < 0:
            try:
                host_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // _MIB
            except (OSError, ValueError):
                host_mb = 32768
            lim = cls(**{**asdict(lim), "memory_mb": max(1024, min(8192, host_mb // 4))})
        return lim


# how the tools say that a limit stopped them (gcc, the assembler and the linker, nvcc's tools through C++)
_OUT_OF_MEMORY = ("out of memory", "virtual memory exhausted", "std::bad_alloc", "cannot allocate memory",
                  "memory allocation fail")  # compared in lower case
_TOO_LARGE = ("File too large",)


def limit_message(log: str, lim: BuildLimits | None = None) -> str | None:
    """What a failed build's log says of the jail's limits, as a sentence for the compile result; None where it
    says nothing of them."""
    lim = lim or BuildLimits.from_env()
    # the tools' own lines only: not a diagnostic at FILE:LINE, nor a quoted source line, which a client writes
    log = "\n".join(ln for ln in log.splitlines() if ln[:1].strip() and not re.match(r"\S+:\d+:(\d+:)? ", ln))
    if lim.file_mb and any(s in log for s in _TOO_LARGE):
        return (f"the build wrote a file larger than its limit of {lim.file_mb} MiB per file (objects and the "
                "extension) and failed: a large initialised array or an .incbin makes one; fill big tables at run "
                "time instead")
    if lim.memory_mb and any(s in log.lower() for s in _OUT_OF_MEMORY):
        return (f"a compiler ran out of its {lim.memory_mb} MiB of memory and failed: an include of a huge file, or "
                "templates or constant evaluation that grow without bound")
    return None


def apply_limits(lim: BuildLimits) -> None:
    """This process's limits, inherited by what it execs (rlimits and an ignored signal survive exec)."""
    if lim.memory_mb:
        resource.setrlimit(resource.RLIMIT_DATA, (lim.memory_mb * _MIB, lim.memory_mb * _MIB))
    if lim.file_mb:
        resource.setrlimit(resource.RLIMIT_FSIZE, (lim.file_mb * _MIB, lim.file_mb * _MIB))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, which tools report


def launcher() -> list[str]:
    # run by path with -I: it imports only the standard library and the confinement modules
    return [sys.executable, "-I", os.path.abspath(__file__), "--"]


def build_env(read: list[str], write: list[str], tmp: str, base: dict[str, str] | None = None,
              keep: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a workspace's ninja: the judge's, scrubbed (`keep`: more variables the compilers
    read), with the jail's rules and limits (`BuildLimits`, from the judge's environment) and a temporary folder
    inside what the compilers may write (nvcc and g++ put intermediate files in TMPDIR)."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if k in _ENV_KEEP or k in keep}
    os.makedirs(tmp, exist_ok=True)
    rules = {"read": read, "write": write, "limits": asdict(BuildLimits.from_env(base))}
    return {**env, "TMPDIR": tmp, JAIL_ENV: json.dumps(rules)}


def confine_here() -> None:
    """Confine this process (and what it execs) by the rules in the environment; a no-op without them.
    Raises OSError when Landlock exists but refuses: a build must not run unconfined by accident."""
    raw = os.environ.get(JAIL_ENV)
    if not raw:
        return
    if _PACKAGE_ROOT not in sys.path:
        sys.path.insert(0, _PACKAGE_ROOT)
    from sandbox.confinement import filesystem, readable

    rules_in = json.loads(raw)
    apply_limits(BuildLimits(**rules_in.get("limits", {})))  # whatever the confinement: limits hold without Landlock
    abi = filesystem.abi_version()
    if abi < 1:  # also CUDA_AGENT_CONFINE=off/mountns: abi_version() reports 0 then
        return
    write = [p for p in rules_in["write"] if os.path.exists(p)]
    rules, _ = readable.read_rules([], [p for p in rules_in["read"] if os.path.exists(p)], [],
                                   devices=BUILD_DEVICES)
    rules += [(w, readable.WRITE) for w in write]
    _private_network()
    filesystem.restrict(rules, abi=abi)


def _private_network() -> None:
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).unshare(0x40000000)  # CLONE_NEWNET; needs CAP_SYS_ADMIN, else no-op
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: jail.py -- COMMAND ARGS...", file=sys.stderr)
        return 2
    try:
        confine_here()
    except OSError as e:
        print(f"cuda-agent build jail: could not confine the build ({e})", file=sys.stderr)
        return 1
    try:
        os.execvp(argv[1], argv[1:])
    except OSError as e:
        print(f"cuda-agent build jail: cannot run {argv[1]}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
