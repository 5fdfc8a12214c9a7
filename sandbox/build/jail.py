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

The rules come from the judge in `CUDA_AGENT_BUILD_JAIL` (JSON: {"read": [...], "write": [...]}), which
`sandbox.build.compile` sets for a workspace's build only: the infrastructure builds compile the
project's own sources. Without the variable, with `CUDA_AGENT_CONFINE` other than `on`, or on a kernel
without Landlock, the command runs unconfined, as before (docs/mcp.md says what that leaves open).
Standard library only, like objcache.py: tens of milliseconds per compile step.
"""

from __future__ import annotations

import json
import os
import sys

JAIL_ENV = "CUDA_AGENT_BUILD_JAIL"
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# what a build's tools need of the judge's environment; anything else (API keys, tokens) stays behind
_ENV_KEEP = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "CUDA_HOME", "CUDA_PATH", "LD_LIBRARY_PATH", "CC",
             "CXX", "CUDA_AGENT_CACHE", "CUDA_AGENT_CONFINE", "CUDA_AGENT_OBJECT_CACHE_MB")


def launcher() -> list[str]:
    # run by path with -I: it imports only the standard library and the confinement modules
    return [sys.executable, "-I", os.path.abspath(__file__), "--"]


def build_env(read: list[str], write: list[str], tmp: str, base: dict[str, str] | None = None,
              keep: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a workspace's ninja: the judge's, scrubbed (`keep`: more variables the compilers
    read), with the jail's rules and a temporary folder inside what the compilers may write (nvcc and g++ put
    intermediate files in TMPDIR)."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if k in _ENV_KEEP or k in keep}
    os.makedirs(tmp, exist_ok=True)
    return {**env, "TMPDIR": tmp, JAIL_ENV: json.dumps({"read": read, "write": write})}


def confine_here() -> None:
    """Confine this process (and what it execs) by the rules in the environment; a no-op without them.
    Raises OSError when Landlock exists but refuses: a build must not run unconfined by accident."""
    raw = os.environ.get(JAIL_ENV)
    if not raw:
        return
    if _PACKAGE_ROOT not in sys.path:
        sys.path.insert(0, _PACKAGE_ROOT)
    from sandbox.confinement import filesystem, readable

    abi = filesystem.abi_version()
    if abi < 1:  # also CUDA_AGENT_CONFINE=off/mountns: abi_version() reports 0 then
        return
    rules_in = json.loads(raw)
    write = [p for p in rules_in["write"] if os.path.exists(p)]
    rules, _ = readable.read_rules([], [p for p in rules_in["read"] if os.path.exists(p)], [])
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
