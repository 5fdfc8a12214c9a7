"""A cgroup `pids` limit for each confined process and each build: the bound on threads and processes that holds as root.

The kernel ignores RLIMIT_NPROC for root (real uid 0 in the initial user namespace, whatever capabilities it
drops), and the judge runs as root on the CI and GPU machines; RLIMIT_DATA bounds a root process's threads only
loosely (a 32 KiB-stack thread costs little data), so one client could take every process id of the host. A pids
controller counts every task (thread or process) of a group and refuses clone() past `pids.max` with EAGAIN,
for root too, and it covers what the process starts (a compile role's compilers, a build's ninja and compilers).

Each confined process joins a group of its own while it still has one thread and before Landlock closes /sys
(`join`, from sandbox.worker.startup.begin); a workspace's build puts ninja in one (sandbox.build.ninja_run). The
groups sit in `cuda-agent-<pid namespace>` beneath this process's own cgroup: in the cgroup v2 hierarchy where
its `pids` controller can be delegated there, else in a v1 `pids` hierarchy. A group is named after its
process's pid; a later join removes the groups of processes that are gone (a group is removable once empty).
Where no writable hierarchy offers `pids` (a container whose /sys/fs/cgroup is read-only, a v2 cgroup that has
processes of its own and cannot delegate, as on the GPU hosts), `join` says so, and the process is bound instead by
RLIMIT_NPROC under a real uid of its own (sandbox.confinement.nproc, `bind_rest`); `serve --help` and docs/mcp.md
say how to give the judge a delegated cgroup.

Standard library only: runs in a worker before torch is imported, and in a build's preexec.
"""

from __future__ import annotations

import os

_STATE: dict[str, str | None] = {}  # "base": the folder the groups go in ("" when none), "why": why there is none
# "uid": no cgroup even where one could be had, the bound is sandbox.confinement.nproc's (tests choose it);
# "judgment": that, and a CPU process takes its judgment's uid as a CUDA one does
MECHANISM_ENV = "CUDA_AGENT_PIDS"
# the kind of device a worker will open ("cpu", "cuda"), set by the judge where it knows it (a pooled worker's
# role says it instead: "idle:cpu")
DEVICE_ENV = "CUDA_AGENT_WORKER_DEVICE"


def _mounts() -> list[tuple[str, str, str, str]]:
    """(fstype, mount root, mount point, super options) of each cgroup mount this process sees."""
    out = []
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                parts, rest = left.split(), right.split()
                if len(parts) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
                    out.append((rest[0], parts[3], parts[4], rest[2]))
    except OSError:
        pass
    return out


def _own_paths() -> tuple[str | None, str | None]:
    """This process's cgroup: (its v2 path, its v1 `pids` path)."""
    v2 = v1 = None
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    v2 = path
                elif "pids" in controllers.split(","):
                    v1 = path
    except (OSError, ValueError):
        pass
    return v2, v1


def _folder(root: str, point: str, path: str) -> str | None:
    """Where cgroup `path` lies under a mount of the hierarchy's `root` at `point` (None: outside the mount)."""
    if root != "/" and not (path == root or path.startswith(root.rstrip("/") + "/")):
        return None
    return os.path.join(point, path[len(root.rstrip("/")):].lstrip("/"))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _v2_base(point: str, own: str) -> str:
    """The folder for groups beneath cgroup `own` of a v2 hierarchy, made and given the pids controller. Raises
    OSError where the controller cannot be delegated there (the no-internal-processes rule: a cgroup that holds
    processes cannot enable controllers for its children, unless it is the root)."""
    if "pids" not in _read(os.path.join(point, "cgroup.controllers")).split():
        raise OSError("the cgroup v2 hierarchy has no pids controller")
    if "pids" not in _read(os.path.join(own, "cgroup.controllers")).split():
        raise OSError(f"this process's cgroup ({own}) is not given the pids controller")
    if "pids" not in _read(os.path.join(own, "cgroup.subtree_control")).split():
        _write(os.path.join(own, "cgroup.subtree_control"), "+pids")
    base = os.path.join(own, _base_name())
    os.makedirs(base, exist_ok=True)
    if "pids" not in _read(os.path.join(base, "cgroup.subtree_control")).split():
        _write(os.path.join(base, "cgroup.subtree_control"), "+pids")
    return base


def _base_name() -> str:
    # per pid namespace: groups are named by pid, and another container's pids are not ours to judge alive
    try:
        return f"cuda-agent-{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return "cuda-agent"


def base() -> str | None:
    """The folder this process's groups go in, found (and made) once; None where there is none (`why` says)."""
    if "base" in _STATE:
        return _STATE["base"] or None
    if (mech := os.environ.get(MECHANISM_ENV, "").strip().lower()) in ("uid", "judgment"):
        _STATE.update(base="", why=f"{MECHANISM_ENV}={mech} chooses RLIMIT_NPROC under a uid of ours")
        return None
    v2_path, v1_path = _own_paths()
    reasons = []
    for fstype, root, point, options in _mounts():
        try:
            if fstype == "cgroup2" and v2_path is not None:
                own = _folder(root, point, v2_path)
                if own:
                    _STATE.update(base=_v2_base(point, own), why=None)
                    return _STATE["base"]
            elif fstype == "cgroup" and v1_path is not None and "pids" in options.split(","):
                own = _folder(root, point, v1_path)
                if own:
                    folder = os.path.join(own, _base_name())
                    os.makedirs(folder, exist_ok=True)
                    _STATE.update(base=folder, why=None)
                    return folder
        except OSError as e:
            reasons.append(f"{point}: {e.strerror or e}")
    _STATE.update(base="", why="; ".join(reasons) or "no cgroup hierarchy with a pids controller is mounted")
    return None


def why_none() -> str:
    base()
    return _STATE.get("why") or ""


def _sweep(folder: str) -> None:
    """End the groups of processes that are gone. A group outlives its process where what that process started
    is still in it: a candidate's or a compiler's children, reparented away from the judge's process tree when
    the worker died (a judge killed by SIGKILL takes its workers with it by their death signal, not their
    children). Those are killed (cgroup v2's `cgroup.kill`, else each process in `cgroup.procs`), and the group is
    removed once empty (rmdir refuses a group that still has tasks: the next sweep takes it)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        pid = name[1:]
        if name[:1] not in ("w", "b") or not pid.isdigit() or os.path.exists(f"/proc/{pid}"):
            continue
        group = os.path.join(folder, name)
        try:
            os.rmdir(group)
            continue
        except OSError:
            pass
        _kill_group(group)
        try:
            os.rmdir(group)
        except OSError:
            pass


def _kill_group(group: str) -> None:
    try:
        _write(os.path.join(group, "cgroup.kill"), "1")  # v2: every task, atomically, racing no fork
        return
    except OSError:
        pass
    for _ in range(3):  # v1: one by one; a process forking meanwhile is caught by the next round
        try:
            pids = [int(x) for x in _read(os.path.join(group, "cgroup.procs")).split()]
        except (OSError, ValueError):
            return
        pids = [p for p in pids if p > 0 and p != os.getpid()]  # 0: a process outside this pid namespace
        if not pids:
            return
        for p in pids:
            try:
                os.kill(p, 9)
            except OSError:
                pass


def sweep() -> None:
    """End the groups of processes that are gone (a judging process's start-up: sandbox/confinement/orphans.py),
    and what dead processes left under a uid of their own (sandbox.confinement.nproc)."""
    from sandbox.confinement import nproc

    folder = base()
    if folder is not None:
        _sweep(folder)
    nproc.sweep()


# this process's group, its pids.max, and the note for the limits' notes (None: join was never called)
JOINED: dict = {"group": None, "max": None, "note": None}


def join(tasks: int, kind: str = "w") -> str:
    """Put this process (every thread of it) in a group of its own that holds at most `tasks` more tasks than it
    has now: its threads, and the processes and threads of what it starts. Returns a note for the limits' notes."""
    JOINED.update(group=None, max=None)
    JOINED["note"] = _join(tasks, kind)
    return JOINED["note"]


def _join(tasks: int, kind: str) -> str:
    if tasks <= 0:
        return "no limit on threads and processes (turned off)"
    folder = base()
    if folder is None:
        return (f"threads and processes: no cgroup pids limit ({why_none()})" + ("; root ignores RLIMIT_NPROC, so "
                "only the memory limit bounds them" if os.getuid() == 0 else ""))
    _sweep(folder)
    pid = os.getpid()
    group = os.path.join(folder, f"{kind}{pid}")
    try:
        now = len(os.listdir(f"/proc/{pid}/task"))
        os.makedirs(group, exist_ok=True)
        _write(os.path.join(group, "pids.max"), str(now + tasks))
        _write(os.path.join(group, "cgroup.procs"), str(pid))
    except OSError as e:
        return f"threads and processes: the cgroup pids limit was not applied ({group}: {e.strerror or e})"
    JOINED.update(group=group, max=now + tasks)
    return f"at most {tasks} more threads and processes (cgroup pids.max {now + tasks})"


def bind_rest(tasks: int, keep_admin: bool = False, device: str | None = None) -> None:
    """Where `join` put this process in no group, as root: RLIMIT_NPROC under a real uid of its own
    (sandbox.confinement.nproc) for a process that will open the CPU only (`device`, else the environment's
    DEVICE_ENV); a process that may open CUDA (or whose device is not known) is prepared to take its judgment's
    uid at its set-up instead (`bind_joined`): CUDA IPC between a judgment's processes needs one real uid. Called
    after `join`, once what needs CAP_SYS_ADMIN is done, while the process still has one thread; its note replaces
    join's. Not for a process that runs tools through a shell: /bin/sh sets its effective uid to a real one that
    differs (a build's ninja: sandbox.build.ninja_run). MECHANISM_ENV "judgment" prepares a CPU process too (tests
    of the CUDA path on a machine without one)."""
    if JOINED["group"] is not None or tasks <= 0:
        return
    from sandbox.confinement import nproc

    device = device or os.environ.get(DEVICE_ENV) or ""
    cpu_only = device == "cpu" and os.environ.get(MECHANISM_ENV, "").strip().lower() != "judgment"
    if os.getuid() != 0 or keep_admin or cpu_only:  # not root: RLIMIT_NPROC binds it as it is
        JOINED["note"] = nproc.bind(tasks, keep_admin)
    else:
        JOINED["note"] = nproc.prepare(tasks)


def bind_joined(tasks: int, starts_tools: bool = False) -> None:
    """At a role's set-up, before its limits: a process `bind_rest` prepared takes its judgment's uid
    (sandbox.confinement.nproc.join; `starts_tools`: one that starts compilers, which CUDA_AGENT_COMPILER_UID=0
    keeps at root's)."""
    from sandbox.confinement import nproc

    note = nproc.join(tasks, starts_tools)
    if note is not None:
        JOINED["note"] = note


def current() -> tuple[str, str] | None:
    """The group of ours this process is in, as (its folder, its pids.max); None where it is in none."""
    v2_path, v1_path = _own_paths()
    for fstype, root, point, options in _mounts():
        path = v2_path if fstype == "cgroup2" else v1_path if "pids" in options.split(",") else None
        folder = _folder(root, point, path) if path is not None else None
        if folder and os.path.basename(os.path.dirname(folder)).startswith("cuda-agent"):
            try:
                return folder, _read(os.path.join(folder, "pids.max")).strip()
            except OSError:
                continue
    return None
