"""Filesystem confinement of processes that run candidate code, with Landlock (raw system calls).

Two stages, because Landlock binds only the calling thread and the threads it creates later:

1. at worker start, before torch is imported (one thread, so the whole process): writes only to the
   worker's scratch directory and the exchange area; no TCP; no signals or ptrace out of the domain;
2. when the process takes a candidate role, before the extension or model_new.py is loaded: reads
   only system and Python roots plus the candidate's own files, writes only scratch and the
   session's exchange directory. Threads torch started between the stages keep stage 1's rights.

The PyPI `landlock` package was looked at (1.0.0.dev5, alpha): it checks errno instead of return
values and has no network or scope rules, so this module speaks to the kernel directly.
"""

from __future__ import annotations

import ctypes
import os
import sys

from sandbox.confinement.readable import (
    EXECUTE,
    IOCTL_DEV,
    READ,
    READ_FILE,
    REFER,
    TRUNCATE,
    WRITE,
    WRITE_FILE,
    candidate_rules,
    device_rules,
    judge_cache_dir,
    task_rules,
    workspace_denials,
)

_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # same on every architecture
_PR_SET_NO_NEW_PRIVS = 38
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2

FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_LIBC = None


def _syscall(*args) -> int:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.syscall.restype = ctypes.c_long
    ctypes.set_errno(0)
    return _LIBC.syscall(*args)


def mode() -> str:
    """CUDA_AGENT_CONFINE: `on` (Landlock, else a mount namespace, else nothing), `off` (nothing: to test
    the fallback or measure the cost), `mountns` (the mount-namespace fallback even where Landlock exists)."""
    value = os.environ.get("CUDA_AGENT_CONFINE", "on").strip().lower()
    return "off" if value in ("off", "0", "no", "false") else "mountns" if value == "mountns" else "on"


def disabled() -> bool:
    return mode() != "on"


def abi_version() -> int:
    """Landlock's ABI version, 0 where the kernel has none (too old, or disabled at boot)."""
    if disabled() or not sys.platform.startswith("linux"):
        return 0
    try:
        v = _syscall(ctypes.c_long(_SYS_CREATE_RULESET), None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return 0
    return max(int(v), 0)


def _handled_fs(abi: int) -> int:
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= REFER
    if abi >= 3:
        rights |= TRUNCATE
    if abi >= 5:
        rights |= IOCTL_DEV
    return rights


class ConfineError(OSError):
    pass


def restrict(rules: list[tuple[str, int]], *, abi: int | None = None, no_tcp: bool = True) -> int:
    """Apply a Landlock domain to this thread (and threads it creates): only `rules` grant file access.

    Paths that do not exist are skipped. Returns the ABI used; raises ConfineError if the kernel refused.
    """
    abi = abi_version() if abi is None else abi
    if abi < 1:
        raise ConfineError("Landlock is not available")
    handled = _handled_fs(abi)
    attr = _RulesetAttr(handled, 0, 0)
    size = 8
    if abi >= 4 and no_tcp:
        attr.handled_access_net = 3  # bind and connect on TCP: none allowed
        size = 16
    if abi >= 6:
        attr.scoped = 3  # abstract unix sockets and signals stay inside the domain
        size = 24
    fd = _syscall(ctypes.c_long(_SYS_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if fd < 0:
        raise ConfineError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for path, access in rules:
            try:
                pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                is_dir = os.path.isdir(f"/proc/self/fd/{pfd}")
                allowed = (access if is_dir else access & FILE_RIGHTS) & handled
                if not allowed:
                    continue
                rule = _PathBeneath(allowed, pfd)
                if _syscall(ctypes.c_long(_SYS_ADD_RULE), ctypes.c_int(fd), ctypes.c_uint(_RULE_PATH_BENEATH),
                            ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
                    raise ConfineError(ctypes.get_errno(), f"landlock_add_rule {path}: "
                                       f"{os.strerror(ctypes.get_errno())}")
            finally:
                os.close(pfd)
        _LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        if _syscall(ctypes.c_long(_SYS_RESTRICT_SELF), ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise ConfineError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(fd)
    return abi


def start_rules(scratch: str, exchange_base: str | None) -> list[tuple[str, int]]:
    """Stage 1: read anywhere, write only scratch and the exchange area (plus device files)."""
    rules = [("/", READ), (scratch, WRITE)] + device_rules()
    if exchange_base:
        rules.append((exchange_base, WRITE))
    return rules


def scratch_env(scratch: str) -> dict[str, str]:
    """Caches and temporary files that CUDA, torch and Triton write, pointed into the scratch directory. TMP and
    TEMP too: glibc drops TMPDIR from a program started in secure-exec mode (a process whose real uid differs from
    its effective one: sandbox/confinement/nproc.py), and gcc's driver then looks at TMP and TEMP before /tmp."""
    return {"TMPDIR": scratch, "TMP": scratch, "TEMP": scratch, "CUDA_CACHE_PATH": os.path.join(scratch, "nv"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(scratch, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(scratch, "triton"), "XDG_CACHE_HOME": os.path.join(scratch, "cache")}


CANDIDATE_CAPABLE = ("candidate", "timer", "judged")  # and pooled "idle:*" workers, which may become either
# times only the reference (eager and torch.compile); never loads candidate code, and is the one role that
# may compile with the judge's persistent Inductor/Triton cache, for a task from the library only
BASELINE_ROLE = "baseline"


def library_baseline(role: str) -> bool:
    """The baseline of a task from the library (the judge handed it the compile cache only then: see
    sandbox.confinement.processes.Worker and tasks.loader.library_task). It runs the project's pinned code and
    no client's, and it is the one process that writes the judge's compile cache, so it is left unconfined, as
    every baseline was: under Landlock, torch.compile's helper processes cannot initialise CUDA (the domain
    grants /proc/self of the worker alone), and the H100's confined baseline came back without a compiled time."""
    return role == BASELINE_ROLE and bool(os.environ.get(COMPILE_CACHE_ENV))
COMPILE_CACHE_ENV = "CUDA_AGENT_COMPILE_CACHE"


def shared_caches_trusted() -> bool:
    """Whether files under the judge's cache directory can be trusted across processes: only where every
    candidate process is confined by Landlock, which keeps them from writing there (stage 1) and from
    reading or listing it (stage 2). A mount namespace, `CUDA_AGENT_CONFINE=off` or a kernel without
    Landlock: not trusted (baselines are sealed per judge process, compiles start cold)."""
    return abi_version() >= 1


def compile_cache_dir() -> str:
    """The judge's persistent Inductor and Triton cache, inside the judge's cache directory: stage 2 keeps
    that directory unreadable, and the mount-namespace fallback covers it."""
    return os.path.join(judge_cache_dir(), "compile")


COMPILE_CACHE_PARTS = ("inductor", "triton", "tmp")


def compile_cache_env(root: str) -> dict[str, str]:
    # TMPDIR too: Inductor keeps its C++ precompiled header in gettempdir()/torchinductor_<user>, not in
    # TORCHINDUCTOR_CACHE_DIR, and rebuilds it (over 10 s on 2 cores) wherever it is missing, cache hit or not
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(root, "inductor"), "TRITON_CACHE_DIR": os.path.join(root, "triton"),
            "TMPDIR": os.path.join(root, "tmp")}


def worker_cache_env(role: str, scratch: str) -> dict[str, str]:
    """Every worker's caches live in its scratch directory, so that no process compiles from a cache that
    a candidate process could have written; the baseline role alone gets the judge's persistent compile
    cache, and only when the judge passed it (it does so where shared caches are trusted)."""
    env = scratch_env(scratch)
    shared = os.environ.get(COMPILE_CACHE_ENV)
    if role == BASELINE_ROLE and shared:
        env.update(compile_cache_env(shared))
    return env


# this worker's own /dev/shm (sandbox.confinement.mountns.private_shm): its host path, or None where it has none
PRIVATE_SHM: dict[str, str | None] = {"host": None}


def own_exchange(shm_dir: str) -> None:
    """The session's exchange folder made in this worker's own /dev/shm, where it has one: it writes its outputs
    there by the session's path, and the judge links them to the process that reads them."""
    if PRIVATE_SHM["host"] and os.path.realpath(shm_dir).startswith("/dev/shm/"):
        os.makedirs(shm_dir, mode=0o700, exist_ok=True)


def at_worker_start(role: str) -> str | None:
    """Stage 1, called before torch is imported, in every worker whatever its role: each of them runs code a
    client wrote, a candidate's or a task's. Returns the confinement applied, or None."""
    scratch = os.environ.get("CUDA_AGENT_SCRATCH")
    if not scratch:
        return None
    os.environ.update(worker_cache_env(role, scratch))
    if library_baseline(role):
        return None
    if mode() != "off":
        from sandbox.confinement import mountns

        PRIVATE_SHM["host"] = mountns.private_shm(scratch)
    abi = abi_version()
    if abi < 1:
        return _mount_namespace(scratch) if mode() != "off" else None
    try:
        restrict(start_rules(scratch, os.environ.get("CUDA_AGENT_EXCHANGE_BASE")), abi=abi)
    except ConfineError as e:
        print(f"confinement: {e}", file=sys.stderr)
        return None
    return f"landlock ABI {abi}"


def _mount_namespace(scratch: str) -> str | None:
    from sandbox.confinement import mountns

    writable = [scratch, os.environ.get("CUDA_AGENT_EXCHANGE_BASE") or "/dev/shm"]
    try:
        mountns.confine(writable, hidden=[judge_cache_dir()])
    except OSError as e:
        print(f"confinement: no mount namespace ({e})", file=sys.stderr)
        return None
    return MOUNT_NAMESPACE


MOUNT_NAMESPACE = "a mount namespace (every mount read-only but scratch and exchange; the judge's cache hidden)"


def for_candidate(started: str | None, shm_dir: str, extension: str | None, model_new: str, task: str,
                  cuda: bool) -> tuple[str | None, list[str]]:
    """Stage 2, called before the task's or the candidate's code is loaded. Returns (confinement, notes)."""
    scratch = os.environ.get("CUDA_AGENT_SCRATCH")
    own_exchange(shm_dir)
    if started is None or not scratch:
        return None, []
    if started == MOUNT_NAMESPACE:
        return started, ["reads are not confined (no Landlock): other workspaces stay readable"]
    dirs = [os.path.dirname(extension)] if extension else []
    rules, notes = candidate_rules(scratch, shm_dir, [model_new, task], dirs, workspace_denials([model_new, task]),
                                   cuda)
    return _apply(started, rules, notes)


def for_task(started: str | None, files: list[str], compiles: bool = False) -> tuple[str | None, list[str]]:
    """Stage 2 of a process that runs a task's reference and no candidate, before the task is loaded: reads
    of the system, Python and the task `files` only (and the compilers, where torch.compile may start them);
    writes of scratch."""
    scratch = os.environ.get("CUDA_AGENT_SCRATCH")
    if started is None or not scratch:
        return None, []
    if started == MOUNT_NAMESPACE:
        return started, ["reads are not confined (no Landlock): other workspaces stay readable"]
    rules, notes = task_rules(scratch, os.environ.get("CUDA_AGENT_EXCHANGE_BASE"), files, workspace_denials(files),
                              compiles)
    return _apply(started, rules, notes)


def _apply(started: str, rules: list[tuple[str, int]], notes: list[str]) -> tuple[str, list[str]]:
    try:
        restrict(rules)
    except ConfineError as e:
        return started, [f"reads are not confined ({e})"]
    return started + ", reads confined", notes
