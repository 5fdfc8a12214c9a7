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
BOUND: dict = {"uid": None}  # the real uid this process took (None: bind did not take one)


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
        # getpass.getuser() (Inductor's cache folders) asks for the real uid's name, which has none
        for key in ("USER", "LOGNAME"):
            os.environ.setdefault(key, pwd.getpwuid(0).pw_name)
        resource.setrlimit(resource.RLIMIT_NPROC, (1 + tasks, 1 + tasks))
        os.setresuid(uid, -1, -1)
        _drop_caps(libc, DROPPED)
        BOUND["uid"] = uid
    except OSError as e:
        return f"threads and processes: RLIMIT_NPROC under a uid of its own was not applied ({e})"
    return (f"at most {tasks} more threads and processes (RLIMIT_NPROC {1 + tasks} under real uid {uid}; no cgroup "
            "pids group here)")


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
    """Kill every process whose real uid is one of ours whose owner (the process `uid - BASE`) is gone or no longer
    holds it (its pid reused). Returns how many were killed."""
    if os.geteuid() != 0:
        return 0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0
    uids = {p: _real_uid(p) for p in pids}
    killed, own_ns = 0, _pid_ns("self")
    for pid, uid in uids.items():
        if uid is None or not BASE <= uid < BASE + PID_MAX or int(pid) == os.getpid():
            continue
        if _pid_ns(pid) != own_ns:  # a nested pid namespace numbers its processes otherwise: not ours to judge
            continue
        owner = str(uid - BASE)
        if uids.get(owner) == uid:  # the process that took this uid is alive: its own threads and children
            continue
        try:
            os.kill(int(pid), 9)
            killed += 1
        except OSError:
            pass
    return killed
