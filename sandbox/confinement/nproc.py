"""RLIMIT_NPROC that binds root: the bound on threads and processes where no cgroup pids group can be had.

The GPU hosts run the judge as root in a cgroup v2 leaf that holds processes of its own, so the pids controller
cannot be delegated beneath it (sandbox.confinement.pidgroup finds no base there), and a container whose
/sys/fs/cgroup is read-only is the same. RLIMIT_NPROC is the other bound the kernel offers, but copy_process()
skips it for a task whose real uid is root or that holds CAP_SYS_RESOURCE or CAP_SYS_ADMIN. So a confined process
that joined no group, as root:

- takes a real uid of its own, `BASE + its pid`: RLIMIT_NPROC counts the tasks of a real uid, so the count is its
  own threads and what it starts, and no other process's. The effective and saved uids stay 0: file access, the
  device files and the judge's folders are as before (access(2), which asks as the real uid, is the one change);
- drops CAP_SYS_RESOURCE, CAP_SYS_ADMIN, CAP_SETUID and CAP_SETPCAP from its bounding, permitted, effective and
  inheritable sets (and clears the ambient set): it cannot lift the limit, take real uid 0 back, or regain them
  through exec (root's exec gets the bounding set);
- sets RLIMIT_NPROC to its task count now plus `tasks`.

Called while the process has one thread (capabilities are per thread; later threads inherit them) and after what
needs CAP_SYS_ADMIN (its network and mount namespaces). A process that must keep CAP_SYS_ADMIN (an analysis under
ncu: GPU counters are root's) cannot be bound so, and its note says so.

A process that may open CUDA cannot take a uid of its own: the driver maps another process's CUDA IPC memory only
between processes of one real uid ("mapping of buffer object failed" otherwise, either way round, root included;
bench/ipc_uid_probe.py on an H200, 2026-12-03), and a judgment's reference opens its candidate's outputs so. Such a
process instead drops CAP_SYS_RESOURCE and CAP_SYS_ADMIN at its start (`prepare`, one thread) and, at its role's
set-up, takes the uid its judge gave every process of that judgment (`join`: setresuid, which glibc applies to
every thread, then RLIMIT_NPROC). The judge numbers those uids per judging process (`exchange_uid`): the task
process kept between judgments keeps its uid, and a later judgment that takes it takes its uid too. Such a
process keeps CAP_SETUID (no thread but the caller's can drop it later); the seccomp filter, installed right after,
refuses every uid change. A judgment's processes share one count, so each may start `2 * tasks` beyond its own
threads at its set-up: the judgment together at most that beyond the largest of them.

`sweep` ends what a dead process left under its uid (a candidate's or a compiler's children set adrift), as
pidgroup's sweep does for groups. Standard library only: runs in a worker before torch, and in a build's preexec.
"""

from __future__ import annotations

import ctypes
import os
import pwd
import resource

# above systemd's container range (524288-1879048191) and below 2^31 (some tools read uids as signed); a pid is
# at most 2^22, so every uid here is BASE + a pid
BASE = 0x70000000
PID_MAX = 1 << 22
CAP_SETUID, CAP_SETPCAP, CAP_SYS_ADMIN, CAP_SYS_RESOURCE = 7, 8, 21, 24
DROPPED = (CAP_SYS_RESOURCE, CAP_SYS_ADMIN, CAP_SETUID, CAP_SETPCAP)  # CAP_SETPCAP last: it drops the others
_PR_CAPBSET_DROP, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
_CAP_V3 = 0x20080522
_SYS_CAPGET, _SYS_CAPSET = 125, 126  # x86_64; aarch64 below
_AARCH64 = (90, 91)
# a judgment's uids (`exchange_uid`): SLOTS of them for each judging process's pid, above the per-process range
EXCHANGE_BASE = BASE + PID_MAX
SLOTS = (0x80000000 - EXCHANGE_BASE) // PID_MAX  # 63
PREPARED = (CAP_SYS_RESOURCE, CAP_SYS_ADMIN)  # what a process that joins later can drop at its start
# "uid": the real uid this process took (None: none taken); "pending": prepared, joins its judgment's uid at its
# set-up; "given": the judgment's uid its judge sent (sandbox.worker.protocol reads it from any request)
BOUND: dict = {"uid": None, "pending": False, "given": None}


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _numbers() -> tuple[int, int]:
    return _AARCH64 if os.uname().machine == "aarch64" else (_SYS_CAPGET, _SYS_CAPSET)


def _drop_caps(libc, caps: tuple[int, ...]) -> None:
    for cap in caps:
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(err)}")
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    get, put = _numbers()
    header, data = _Header(_CAP_V3, 0), (_Data * 2)()
    if libc.syscall(get, ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capget: {os.strerror(err)}")
    for cap in caps:
        word, bit = divmod(cap, 32)
        mask = ~(1 << bit) & 0xFFFFFFFF
        data[word].effective &= mask
        data[word].permitted &= mask
        data[word].inheritable &= mask
    if libc.syscall(put, ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")


def _name_user() -> None:
    """getpass.getuser() (Inductor's cache folders) asks for the real uid's name, which a uid of ours has not."""
    for key in ("USER", "LOGNAME"):
        os.environ.setdefault(key, pwd.getpwuid(0).pw_name)


def own_uid(pid: int | None = None) -> int:
    return BASE + (os.getpid() if pid is None else pid) % PID_MAX


def bind(tasks: int, keep_admin: bool = False) -> str:
    """Bound this process (one thread) at `tasks` more threads and processes through RLIMIT_NPROC, as root.
    Returns a note for the limits' notes; raises nothing (a failure is the note)."""
    if tasks <= 0:
        return "no limit on threads and processes (turned off)"
    if os.getuid() != 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (1 + tasks, 1 + tasks))  # binds a user as it is
        return f"at most {tasks} more threads and processes (RLIMIT_NPROC {1 + tasks})"
    if keep_admin:
        return ("threads and processes: no cgroup pids limit, and this process keeps root's CAP_SYS_ADMIN (GPU "
                "counters), under which the kernel ignores RLIMIT_NPROC: only its time limit bounds them")
    uid = own_uid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    try:
        _name_user()
        resource.setrlimit(resource.RLIMIT_NPROC, (1 + tasks, 1 + tasks))
        os.setresuid(uid, -1, -1)
        _drop_caps(libc, DROPPED)
        BOUND["uid"] = uid
    except OSError as e:
        return f"threads and processes: RLIMIT_NPROC under a uid of its own was not applied ({e})"
    return (f"at most {tasks} more threads and processes (RLIMIT_NPROC {1 + tasks} under real uid {uid}; no cgroup "
            "pids group here)")


def exchange_uid(slot: int, judge_pid: int | None = None) -> int:
    """The uid of a judgment numbered `slot` (0 <= slot < SLOTS) of the judging process `judge_pid`."""
    return EXCHANGE_BASE + slot * PID_MAX + (os.getpid() if judge_pid is None else judge_pid) % PID_MAX


def prepare(tasks: int) -> str:
    """At the start of a process that may open CUDA (one thread): drop what would let it ignore RLIMIT_NPROC, so
    that `join` can bound it once it knows its judgment's uid. Returns the note until then."""
    if tasks <= 0:
        return "no limit on threads and processes (turned off)"
    try:
        _drop_caps(ctypes.CDLL(None, use_errno=True), PREPARED)
    except OSError as e:
        return f"threads and processes: no cgroup pids limit here, and the capabilities could not be dropped ({e})"
    BOUND["pending"] = True
    return ("threads and processes: no cgroup pids limit here; bounded at the role's set-up under the judgment's "
            "uid (RLIMIT_NPROC)")


def own_tasks() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 64  # a process of the judge's has tens of threads at its set-up


# "0": a process that starts compilers keeps root's real uid (see `join`)
TOOLS_ENV = "CUDA_AGENT_COMPILER_UID"


def join(tasks: int, starts_tools: bool = False) -> str | None:
    """At a prepared process's set-up (any number of threads), before the seccomp filter: take the judgment's uid
    its judge sent, and RLIMIT_NPROC at `2 * tasks` beyond its threads now. Returns the note, or None where the
    process was not prepared. Without a uid from its judge (a process started outside a judgment) it stays as it
    is, and the note says so.

    `starts_tools` (a baseline's torch.compile: Triton's gcc and ptxas): a program started from a differing real
    uid runs in secure-exec mode, where glibc drops TMPDIR (and LD_LIBRARY_PATH); Triton's gcc aborted so on the
    H200 host, unable to make a temporary file, until workers got TMP and TEMP beside it
    (sandbox.confinement.filesystem.scratch_env), after which a confined CUDA baseline compiled under its
    judgment's uid (2026-12-03). TOOLS_ENV "0" keeps such a process at root's real uid, unbounded as before."""
    if not BOUND["pending"]:
        return None
    BOUND["pending"] = False
    if starts_tools and os.environ.get(TOOLS_ENV) == "0":
        return ("threads and processes: no cgroup pids limit, and a process that starts compilers keeps root's real "
                f"uid ({TOOLS_ENV}=0), under which the kernel ignores RLIMIT_NPROC: only the memory limit bounds them")
    uid = BOUND["given"]
    if not isinstance(uid, int) or not EXCHANGE_BASE <= uid < EXCHANGE_BASE + SLOTS * PID_MAX:
        return ("threads and processes: no cgroup pids limit, and no judgment's uid was given to this process (it "
                "keeps root's, under which the kernel ignores RLIMIT_NPROC): only the memory limit bounds them")
    limit = own_tasks() + 2 * tasks
    try:
        _name_user()
        resource.setrlimit(resource.RLIMIT_NPROC, (limit, limit))
        os.setresuid(uid, -1, -1)  # glibc: every thread (the device's own included)
        BOUND["uid"] = uid
    except OSError as e:
        return f"threads and processes: RLIMIT_NPROC under the judgment's uid was not applied ({e})"
    return (f"at most {2 * tasks} more threads and processes (RLIMIT_NPROC {limit} under real uid {uid}, shared "
            "with the judgment's other processes: CUDA IPC needs one uid; no cgroup pids group here)")


def _owner(uid: int) -> str | None:
    """The pid whose life a uid of ours follows: its process's (BASE range) or its judging process's (a
    judgment's); None for a uid not ours."""
    if BASE <= uid < EXCHANGE_BASE:
        return str(uid - BASE)
    if EXCHANGE_BASE <= uid < EXCHANGE_BASE + SLOTS * PID_MAX:
        return str((uid - EXCHANGE_BASE) % PID_MAX)
    return None


def _real_uid(pid: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _pid_ns(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def sweep() -> int:
    """Kill every process whose real uid is one of ours whose owner is gone: the process `uid - BASE`, gone or no
    longer holding the uid (its pid reused), or a judgment's judging process, gone. Returns how many were
    killed."""
    if os.geteuid() != 0:
        return 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    uids = {p: _real_uid(p) for p in pids}
    killed, own_ns = 0, _pid_ns("self")
    for pid, uid in uids.items():
        owner = _owner(uid) if uid is not None else None
        if owner is None or int(pid) == os.getpid():
            continue
        if _pid_ns(pid) != own_ns:  # a nested pid namespace numbers its processes otherwise: not ours to judge
            continue
        if uid < EXCHANGE_BASE and uids.get(owner) == uid:  # the process that took it is alive: its own threads
            continue
        if uid >= EXCHANGE_BASE and owner in uids:  # the judging process is alive: its judgments end with it
            continue
        try:
            os.kill(int(pid), 9)
            killed += 1
        except OSError:
            pass
    return killed
