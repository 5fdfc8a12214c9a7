"""Resource limits of processes that run candidate code: rlimits, and a seccomp filter for what root ignores.

Applied by the candidate role just before the candidate's code is loaded (the worker's own start-up,
torch's thread pools and, in a reference timer, torch.compile's helper processes stay unlimited).
Both rlimits and a seccomp filter installed with TSYNC bind the whole process, every thread included.

- Host memory: RLIMIT_DATA, not RLIMIT_AS. CUDA reserves tens of GiB of address space it never
  touches (PROT_NONE ranges, shared device mappings), so an address-space limit breaks CUDA; the data
  limit counts only private writable mappings (malloc, anonymous mmap, thread stacks) since Linux 4.7.
- Open files (RLIMIT_NOFILE), file size (RLIMIT_FSIZE), CPU seconds (RLIMIT_CPU, summed over threads).
- Processes: a seccomp filter (raw BPF, x86_64 and aarch64) kills the process on any attempt to start a
  process (fork, vfork, clone without CLONE_THREAD), and refuses raising rlimits (root could) and ptrace.
  Threads stay allowed (torch needs them). Their number (and, in the roles that may start processes, the
  processes') is bounded by a cgroup pids group the process joined at its start (`sandbox.confinement.
  pidgroup`), or where none can be had by RLIMIT_NPROC, as root under a real uid of the process's own
  (`sandbox.confinement.nproc`, CPU processes only): the data limit let hundreds of thousands of small-stack
  threads through. The filter refuses setuid, setreuid and setresuid, root's way back to real uid 0, and
  mount, unshare and setns, so the mount-namespace fallback of `sandbox.confinement.mountns` cannot be undone by a candidate that is
  root in its namespace.

The judge reads the limits from the environment (`ResourceLimits.from_env`) and hands them to the
worker in CUDA_AGENT_LIMITS; `CUDA_AGENT_LIMIT_<FIELD>` overrides one (tests use small ones), and
`CUDA_AGENT_LIMITS=off` turns them all off (to measure their cost).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
from dataclasses import asdict, dataclass, fields

from sandbox.confinement import nproc, pidgroup

_MIB = 1 << 20


def _physical_mb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // _MIB
    except (OSError, ValueError):
        return 16384


@dataclass(frozen=True)
class ResourceLimits:
    """0 turns a limit off."""

    data_mb: int = 0  # 0 here means the default: half the machine's memory, at most 32 GiB
    nofile: int = 4096
    fsize_mb: int = 4096  # CPU outputs travel by file; the largest KernelBench outputs are far below
    cpu_s: int = 3600  # a backstop: every operation's wall-clock timeout comes first
    threads: int = 1024  # threads and processes over those at the process's start: its cgroup pids group, else
    # RLIMIT_NPROC (as root under a real uid of its own: sandbox.confinement.nproc)
    no_processes: int = 1  # the seccomp filter (no new processes, no rlimit raising, no ptrace)

    @classmethod
    def from_env(cls) -> ResourceLimits:
        raw = os.environ.get("CUDA_AGENT_LIMITS", "")
        if raw.strip().lower() == "off":
            return cls(**{f.name: 0 for f in fields(cls)})
        values = json.loads(raw) if raw else {}
        for f in fields(cls):
            env = os.environ.get(f"CUDA_AGENT_LIMIT_{f.name.upper()}")
            if env is not None:
                values[f.name] = int(env)
        lim = cls(**{k: int(v) for k, v in values.items() if k in {f.name for f in fields(cls)}})
        if lim.data_mb == 0 and "data_mb" not in values:
            lim = cls(**{**asdict(lim), "data_mb": min(32768, _physical_mb() // 2)})
        return lim

    def to_env(self) -> str:
        return json.dumps(asdict(self))


def _user_tasks(uid: int) -> int:
    """At least the processes and threads of `uid` now (what RLIMIT_NPROC compares against): the machine's
    count from /proc/loadavg, which a confined process can read, else the user's from /proc's listing."""
    try:
        with open("/proc/loadavg") as f:
            return int(f.read().split()[3].split("/")[1])
    except (OSError, IndexError, ValueError):
        pass
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.stat(f"/proc/{pid}").st_uid == uid:
                    n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return n


def _set(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def set_rlimits(lim: ResourceLimits) -> list[str]:
    applied = []
    if lim.data_mb:
        _set(resource.RLIMIT_DATA, lim.data_mb * _MIB)
        applied.append(f"memory {lim.data_mb} MiB (RLIMIT_DATA)")
    if lim.nofile:
        _set(resource.RLIMIT_NOFILE, lim.nofile)
        applied.append(f"{lim.nofile} open files")
    if lim.fsize_mb:
        _set(resource.RLIMIT_FSIZE, lim.fsize_mb * _MIB)
        applied.append(f"files up to {lim.fsize_mb} MiB")
    if lim.cpu_s:
        soft = lim.cpu_s
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        # SIGXCPU at the soft limit, SIGKILL at the hard one should SIGXCPU be caught
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 5 if hard == resource.RLIM_INFINITY else hard))
        applied.append(f"{lim.cpu_s} CPU seconds")
    if lim.threads and os.getuid() != 0 and pidgroup.JOINED["group"] is None and not nproc.BOUND["uid"]:
        uid = os.getuid()
        _set(resource.RLIMIT_NPROC, _user_tasks(uid) + lim.threads)
        applied.append(f"{lim.threads} more threads (RLIMIT_NPROC)")
    return applied


# --- seccomp ----------------------------------------------------------------------------------------

_ARCH = {  # AUDIT_ARCH, then the system call numbers the filter names (None: the architecture has none)
    "x86_64": (0xC000003E, dict(fork=57, vfork=58, clone=56, clone3=435, setrlimit=160, prlimit64=302,
                                ptrace=101, seccomp=317, mount=165, umount2=166, pivot_root=155, unshare=272,
                                setns=308, setpriority=141, sched_setparam=142, sched_setscheduler=144,
                                sched_setaffinity=203, ioprio_set=251, sched_setattr=314, inotify_init=253,
                                inotify_add_watch=254, inotify_init1=294, fanotify_init=300, fanotify_mark=301,
                                setuid=105, setreuid=113, setresuid=117)),
    "aarch64": (0xC00000B7, dict(fork=None, vfork=None, clone=220, clone3=435, setrlimit=164, prlimit64=261,
                                 ptrace=117, seccomp=277, mount=40, umount2=39, pivot_root=41, unshare=97,
                                 setns=268, setpriority=140, sched_setparam=118, sched_setscheduler=119,
                                 sched_setaffinity=122, ioprio_set=30, sched_setattr=274, inotify_init=None,
                                 inotify_add_watch=27, inotify_init1=26, fanotify_init=262, fanotify_mark=263,
                                 setuid=146, setreuid=145, setresuid=147)),
}
# the new mount API has the same numbers everywhere
_MOUNT_API = dict(open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                  mount_setattr=442)
_NO_MOUNTS = ("mount", "umount2", "pivot_root", "unshare", "setns", *_MOUNT_API)
# another process's scheduling (a real-time or deadline policy, priority, affinity, I/O priority) is a way
# to slow eager's timer from the candidate's process; a confined process changes no one's, its own included
_NO_SCHEDULING = ("setpriority", "sched_setparam", "sched_setscheduler", "sched_setaffinity", "ioprio_set",
                  "sched_setattr")
# watching files: an inotify watch needs only a path lookup, which Landlock does not mediate, so a watch on /dev/shm
# or a server's root named every other judgment's files as they were made (issue 69, case 1); fanotify is root's
# whole-mount variant. No kernel or task needs them
_NO_WATCHING = ("inotify_init", "inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark")
# a root process bound by RLIMIT_NPROC under a real uid of its own (sandbox.confinement.nproc) keeps effective uid 0,
# and may set its real uid to its effective one without CAP_SETUID: back to root, whom the limit does not bind
_NO_SETUID = ("setuid", "setreuid", "setresuid")
_RET_KILL_PROCESS, _RET_ERRNO, _RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
_EPERM, _ENOSYS = 1, 38
_CLONE_THREAD = 0x00010000
_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06
_PR_SET_NO_NEW_PRIVS = 38
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1


class _Insn(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Insn))]


def _program(audit_arch: int, nr: dict, processes: bool = False) -> list[tuple[int, int, int, int]]:
    """The filter as (code, jt, jf, k) rows; jumps are relative, so it is built back to front."""
    kill, allow = (_RET_K, 0, 0, _RET_KILL_PROCESS), (_RET_K, 0, 0, _RET_ALLOW)
    eperm, enosys = (_RET_K, 0, 0, _RET_ERRNO | _EPERM), (_RET_K, 0, 0, _RET_ERRNO | _ENOSYS)
    tail: list = [allow]

    def on(name: str, body: list) -> None:
        """Prepend: if nr == name run body (which must return), else fall through to what follows."""
        if nr.get(name) is None:
            return
        tail[:0] = [(_LD_W_ABS, 0, 0, 0), (_JEQ_K, 0, len(body), nr[name])] + body

    for name in _NO_MOUNTS:  # the mount-namespace fallback (sandbox.confinement.mountns) must not be undone
        on(name, [eperm])
    for name in _NO_SCHEDULING + _NO_WATCHING + _NO_SETUID:
        on(name, [eperm])
    on("ptrace", [eperm])
    on("setrlimit", [eperm])
    # prlimit64(pid, resource, new, old): reading (new == NULL) stays allowed
    on("prlimit64", [(_LD_W_ABS, 0, 0, 32), (_JEQ_K, 0, 3, 0), (_LD_W_ABS, 0, 0, 36), (_JEQ_K, 0, 1, 0),
                     allow, eperm])
    if not processes:
        on("clone3", [enosys])  # its flags sit behind a pointer; glibc falls back to clone, which is checked
        on("clone", [(_LD_W_ABS, 0, 0, 16), (_JSET_K, 1, 0, _CLONE_THREAD), kill, allow])
        on("vfork", [kill])
        on("fork", [kill])
    # another architecture's calls (i386 through int 0x80, x32) would pass the checks: none allowed
    head = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 1, 0, audit_arch), kill, (_LD_W_ABS, 0, 0, 0),
            (0x35, 0, 1, 0x40000000), kill]  # 0x35: jge; x32 numbers carry bit 30
    return head + tail


def seccomp_supported() -> bool:
    return platform.machine() in _ARCH


def install_seccomp(processes: bool = False) -> None:
    """Install the filter on every thread of this process (TSYNC). Raises OSError if refused. `processes`
    leaves new processes allowed (torch.compile's compilers in a reference's baseline and probe)."""
    audit_arch, nr = _ARCH[platform.machine()]
    nr = {**_MOUNT_API, **nr}
    rows = _program(audit_arch, nr, processes)
    insns = (_Insn * len(rows))(*[_Insn(*r) for r in rows])
    prog = _Prog(len(rows), insns)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    rc = libc.syscall(ctypes.c_long(nr["seccomp"]), ctypes.c_uint(_SECCOMP_SET_MODE_FILTER),
                      ctypes.c_uint(_SECCOMP_FILTER_FLAG_TSYNC), ctypes.byref(prog))
    if rc != 0:
        err = ctypes.get_errno() if rc < 0 else 0
        raise OSError(err, f"seccomp: {os.strerror(err) if err else f'thread {rc} could not be synchronised'}")


def apply(lim: ResourceLimits | None = None, processes: bool = False) -> list[str]:
    """Apply every limit to this process; returns what was applied, and what could not be, as notes.
    `processes`: new processes stay allowed (the rest of the seccomp filter applies)."""
    lim = lim or ResourceLimits.from_env()
    notes = []
    if pidgroup.JOINED["note"]:
        notes.append("limits: " + str(pidgroup.JOINED["note"]))
    try:
        applied = set_rlimits(lim)
        if applied:
            notes.append("limits: " + ", ".join(applied))
    except (OSError, ValueError) as e:
        notes.append(f"limits: rlimits not applied ({e})")
    if lim.no_processes:
        if not seccomp_supported():
            notes.append(f"limits: no seccomp filter on {platform.machine()}: new processes are not refused"
                         + (" (and root ignores RLIMIT_NPROC)" if os.getuid() == 0 else ""))
        else:
            try:
                install_seccomp(processes)
                notes.append("limits: seccomp refuses " + ("" if processes else "new processes (the process is "
                             "killed), ") + "rlimit raising, ptrace, scheduling changes, mount changes, file watches "
                             "and uid changes")
            except OSError as e:
                notes.append(f"limits: seccomp filter refused ({e})")
    return notes


# what pthread_create's EAGAIN (the pids group full, RLIMIT_NPROC) looks like from Python and from C++
_THREAD_SIGNS = ("can't start new thread", "Resource temporarily unavailable")
_MEMORY_SIGNS = ("std::bad_alloc", "MemoryError", "Cannot allocate memory", "cannot allocate memory")


def explain_death(returncode: int | None, log_tail: str, lim: ResourceLimits | None = None) -> tuple[str, str] | None:
    """Why a candidate process died, when this module's filter or limits killed it: (reason, message),
    else None (an ordinary crash). Starting a process is work outside the call, the integrity reason
    `background_work`, so it costs the reward wherever it happens; the limits give `resource_limit`."""
    lim = lim or ResourceLimits.from_env()
    sig = -returncode if returncode is not None and returncode < 0 else 0
    if sig == 31:  # SIGSYS: the seccomp filter
        return "background_work", ("the candidate's code tried to start a process (fork, vfork, clone or posix_spawn), "
                                   "which the sandbox forbids: the process was killed")
    if sig == 24:  # SIGXCPU
        return "resource_limit", f"the candidate's process used more than its {lim.cpu_s} CPU seconds and was killed"
    if sig == 25:  # SIGXFSZ
        return "resource_limit", f"the candidate's process wrote a file larger than {lim.fsize_mb} MiB and was killed"
    if lim.threads and any(s in log_tail for s in _THREAD_SIGNS):
        return "resource_limit", (f"the candidate's process could not start a thread: it reached its limit of "
                                  f"{lim.threads} threads (and processes) and died")
    if lim.data_mb and any(s in log_tail for s in _MEMORY_SIGNS):
        return "resource_limit", (f"the candidate's process ran out of its {lim.data_mb} MiB of host memory "
                                  "(RLIMIT_DATA) and died")
    return None
