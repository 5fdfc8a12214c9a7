"""The user's template daemon, the judge's side: how a judge without a template of its own finds one.

A one-shot judge process (`cuda-agent verify ws/`) would pay a template's imports before its first fork,
so it used to start every worker by exec (torch imported in each). The daemon is a template
(sandbox.worker.template) that outlives the CLI: `python -P -m sandbox.worker.daemon`, one per user and
key, listening on a unix socket in a private directory of the judge's cache (`<cache>/daemon`, mode
0700). The key is a hash of everything a fork depends on: the worker environment that the template's
imports saw (`import_env`), the Python executable, the judge's source and torch's installed version. A
judge looks for the daemon of its key before each worker; if none answers it starts one, detached, and
starts this worker by exec: later calls find it ready. Standard library only: the daemon imports it.

Connections are accepted only from processes of the same user that are not confined workers (`refusal`):
candidates run as the same user, and a worker forked at a candidate's request would start unconfined.
`CUDA_AGENT_TEMPLATE_IDLE_S` sets how long a daemon waits without work before it exits (0: no daemon).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time

from sandbox.confinement import filesystem, proctree
from sandbox.confinement.template import Channel, TemplateError, import_env

IDLE_ENV = "CUDA_AGENT_TEMPLATE_IDLE_S"
DEFAULT_IDLE_S = 300.0
# the daemon listens only once its imports are done, so a fork is answered at once or never
FORK_TIMEOUT_S = 30.0
# with fewer CPUs a new daemon imports only after the call that started it: that call's two exec'd workers
# import torch meanwhile, and a third import beside them would make the first call slower than it was
PARALLEL_START_CPUS = 4
# a process that judges more than once (not a one-shot CLI call) waits this long for a starting daemon's imports
# rather than start its first workers by exec: eight judgments at once on a GPU host started sixteen workers by
# exec (4-5 s each, importing torch beside each other and beside the daemon), where the daemon forks each in
# milliseconds once ready. Not where the daemon defers its imports (fewer than PARALLEL_START_CPUS)
READY_WAIT_S = 20.0
_SUN_PATH_MAX = 107
SOURCE_PACKAGE = "sandbox"  # all a worker or the template imports besides torch and the standard library


class DaemonError(Exception):
    """No daemon can be used here (said once on stderr; workers start by exec)."""


def idle_s() -> float:
    try:
        return max(0.0, float(os.environ.get(IDLE_ENV, DEFAULT_IDLE_S)))
    except ValueError:
        return DEFAULT_IDLE_S


def directory() -> str:
    """Inside the judge's cache: the directory that candidates' confinement keeps unreadable."""
    return os.path.join(filesystem.judge_cache_dir(), "daemon")


def private_dir() -> str:
    """The socket directory, made if missing; refused unless it is a directory of this user's alone."""
    path = directory()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise DaemonError(f"no template daemon: {path} is not a private directory of this user "
                          f"(mode {stat.filemode(st.st_mode)}, owner {st.st_uid})")
    return path


# ---- the key -------------------------------------------------------------------------------------------
_source_memo: dict[tuple, str] = {}


def source_hash(root: str) -> str:
    """The contents of the package's Python files under `root` (the PYTHONPATH entry workers import it from).
    Their sizes and mtimes pick the memoised hash, so a call costs a directory walk, not a read."""
    files = []
    for d, dirs, names in os.walk(os.path.join(root, SOURCE_PACKAGE)):
        dirs.sort()
        for n in sorted(names):
            if n.endswith(".py"):
                p = os.path.join(d, n)
                st = os.stat(p)
                files.append((p, st.st_size, st.st_mtime_ns))
    sig = tuple(files)
    if sig not in _source_memo:
        h = hashlib.sha256()
        for p, _, _ in files:
            h.update(os.path.relpath(p, root).encode() + b"\0")
            with open(p, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        _source_memo.clear()
        _source_memo[sig] = h.hexdigest()
    return _source_memo[sig]


def _torch_stamp(paths: list[str]) -> str:
    """torch's installed version, as the files pip rewrites on an upgrade (read without importing torch)."""
    for p in paths:
        version = os.path.join(p, "torch", "version.py")
        try:
            st = os.stat(version)
        except OSError:
            continue
        return f"{version}:{st.st_size}:{st.st_mtime_ns}"
    return ""


def key(env: dict[str, str]) -> str:
    """What must match for a fork to be valid: the template refuses other import environments, and a daemon
    of older code or another torch must never serve (a code change gives a new key; the old daemon exits)."""
    imported = import_env(env)
    paths = [p for p in imported.get("PYTHONPATH", "").split(os.pathsep) if p]
    parts = {"python": sys.executable, "env": sorted(imported.items()), "torch": _torch_stamp(paths),
             "source": source_hash(paths[0]) if paths else ""}
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


# ---- who may connect ------------------------------------------------------------------------------------
def peer_creds(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process that connected, as the kernel recorded them at connect()."""
    return struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))


def traits(pid: int | str = "self") -> dict:
    """What sets a confined worker apart from a judge: no_new_privs (Landlock and the seccomp filter set it),
    seccomp filters, and the network and mount namespaces a worker makes its own where it can."""
    out = {"no_new_privs": 0, "seccomp": 0, "seccomp_filters": 0}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            field = {"NoNewPrivs": "no_new_privs", "Seccomp": "seccomp", "Seccomp_filters": "seccomp_filters"}.get(name)
            if field:
                out[field] = int(value.strip() or 0)
    for ns in ("net", "mnt"):
        out[ns] = os.readlink(f"/proc/{pid}/ns/{ns}")
    return out


def refusal(sock: socket.socket, own: dict) -> str | None:
    """Why this connection may not use the daemon, or None. Same user is not enough: candidates run as the
    judge's user, and Landlock does not stop connect() on a named socket; so a process confined further than
    the daemon (`own`: its traits) is refused. A process that cannot be inspected is refused too."""
    pid, uid, _ = peer_creds(sock)
    if uid != os.getuid():
        return f"uid {uid} is not the daemon's user"
    if pid <= 0:
        return "the connecting process is not visible here"
    try:
        peer = traits(pid)
    except (OSError, ValueError):
        return f"process {pid} could not be inspected"
    for ns in ("net", "mnt"):
        if peer[ns] != own[ns]:
            return f"process {pid} is in another {ns} namespace (a worker's)"
    if peer["no_new_privs"] > own["no_new_privs"] or peer["seccomp"] > own["seccomp"] \
            or peer["seccomp_filters"] > own["seccomp_filters"]:
        return f"process {pid} is confined (no_new_privs or a seccomp filter the daemon has not)"
    return None


def unusable_here() -> str | None:
    """Where the judge itself runs with no_new_privs, a worker confined by Landlock alone (no seccomp filter,
    no namespace of its own) looks like it: no daemon then."""
    if traits()["no_new_privs"]:
        return ("no template daemon: this process runs with no_new_privs, so confined workers could not be told "
                f"from it ({IDLE_ENV}=0 to not look for one)")
    return None


# ---- finding or starting the daemon ---------------------------------------------------------------------
_lock = threading.Lock()
_channels: dict[str, Channel] = {}
_spawned: list[subprocess.Popen] = []


def paths(name: str, where: str | None = None) -> dict[str, str]:
    d = where or directory()
    return {k: os.path.join(d, f"{name}.{k}") for k in ("sock", "lock", "log", "tmp")}


def channel(env: dict[str, str], wait: bool = False) -> Channel | None:
    """A connection to the ready daemon of this worker environment's key, or None (none ready: one is
    started if none is starting). `wait`: a starting daemon is waited for, up to READY_WAIT_S, where it imports
    at once (_await_ready). Raises DaemonError where no daemon may be used."""
    if idle_s() <= 0:
        return None
    name = key(env)
    with _lock:
        for p in [p for p in _spawned if p.poll() is not None]:  # reaped: a daemon that exited is no zombie of ours
            _spawned.remove(p)
        found = _channels.get(name)
        if found is not None and not found.broken:
            return found
        why = unusable_here()
        if why:
            raise DaemonError(why)
        where = private_dir()
        files = paths(name, where)
        if len(files["sock"]) + 8 > _SUN_PATH_MAX:  # and the daemon binds it first as <sock>.<pid>
            raise DaemonError(f"no template daemon: the socket path is too long ({files['sock']})")
        sock = connect(files["sock"])
        if sock is None:
            start(name, env, where)
            if not wait or READY_WAIT_S <= 0 or len(os.sched_getaffinity(0)) < PARALLEL_START_CPUS:
                return None
            sock = _await_ready(files, READY_WAIT_S)
            if sock is None:
                return None
        _channels[name] = Channel(sock, timeout=FORK_TIMEOUT_S)
        return _channels[name]


def _await_ready(files: dict[str, str], limit: float) -> socket.socket | None:
    """A connection once the starting daemon listens (its imports done), or None: not within `limit`, or its
    lock is free (no daemon starting or running: it failed)."""
    deadline = time.monotonic() + limit
    fd = _open_lock(files["lock"])
    try:
        while time.monotonic() < deadline:
            sock = connect(files["sock"])
            if sock is not None:
                return sock
            if not _held(fd):
                fcntl.flock(fd, fcntl.LOCK_UN)  # taken by the probe: not ours to keep
                return None
            time.sleep(0.05)
        return None
    finally:
        os.close(fd)


def connect(path: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
    except OSError:  # no file (none ready yet), or a file no daemon listens on (it died): start one
        sock.close()
        return None
    return sock


def _held(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    return False


def _open_lock(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def start(name: str, env: dict[str, str], where: str) -> bool:
    """Start the daemon of `name`, unless one holds its lock (starting, or running): the lock is taken here
    and handed to the daemon, which holds it while it lives, so two judges never start two. Only the lock's
    holder touches the socket, log and scratch paths, so a dead daemon's leftovers are simply replaced."""
    files = paths(name, where)
    if proctree.is_subreaper():
        # the daemon would stay in this process's tree however detached, and an MCP helper kills its tree when
        # its call ends: on a 2 x H200 host the daemon one helper started died so under the check workers it
        # had forked for fifteen others (their exit status lost, every one a judge error). Such a process uses
        # a daemon that others started, or its server's template, and starts its own workers by exec otherwise
        return False
    fd = _open_lock(files["lock"])
    try:
        if _held(fd):
            return False
        _clear(name, where)
        os.mkdir(files["tmp"], 0o700)
        # the environment a template gets: the imports' part of the worker's, a scratch directory of its own
        denv = {**import_env(env), **filesystem.scratch_env(files["tmp"])}
        defer = os.getpid() if len(os.sched_getaffinity(0)) < PARALLEL_START_CPUS else 0
        cmd = [sys.executable, "-P", "-m", "sandbox.worker.daemon", str(fd), where, name, str(idle_s()), str(defer)]
        with open(os.open(files["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb") as log:
            proc = subprocess.Popen(cmd, pass_fds=(fd,), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, cwd=files["tmp"], env=denv, start_new_session=True)
        os.ftruncate(fd, 0)
        os.write(fd, f"{proc.pid}\n".encode())  # for `stop`, which finds daemons still importing by it
        _spawned.append(proc)
        return True
    finally:
        os.close(fd)


def _clear(name: str, where: str) -> None:
    """A dead daemon's socket (also under its temporary name) and scratch directory; under its lock only."""
    files = paths(name, where)
    for n in os.listdir(where):
        if n == f"{name}.sock" or n.startswith(f"{name}.sock."):
            try:
                os.unlink(os.path.join(where, n))
            except FileNotFoundError:
                pass
    shutil.rmtree(files["tmp"], ignore_errors=True)


# ---- status and stop ------------------------------------------------------------------------------------
def _lock_state(name: str, where: str) -> tuple[bool, int]:
    """(held, pid): whether a daemon of this name lives, and the pid its starter wrote. A free lock is taken
    for a moment, and the dead daemon's socket and scratch removed under it."""
    files = paths(name, where)
    fd = _open_lock(files["lock"])
    try:
        data = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if _held(fd):
            return True, int(data) if data.isdigit() else 0
        _clear(name, where)
        return False, 0
    finally:
        os.close(fd)


def daemons() -> list[dict]:
    """Every daemon of this user's (the cache's daemon directory): its key, pid, state and, once ready, what
    it says of itself (`info`: its imports' times, children, forks served)."""
    where = directory()
    try:
        names = sorted({n.rsplit(".", 1)[0] for n in os.listdir(where) if n.endswith(".lock")})
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        held, pid = _lock_state(name, where)
        if not held:
            continue
        entry: dict = {"key": name, "pid": pid, "state": "starting", "log": paths(name, where)["log"]}
        sock = connect(paths(name, where)["sock"])
        if sock is not None:
            ch = Channel(sock, timeout=5.0)
            try:
                entry.update(state="ready", info=ch.info())
            except TemplateError as e:
                entry.update(state="not answering", error=str(e))
            ch.close()
        out.append(entry)
    return out


def _is_daemon(pid: int, name: str) -> bool:
    try:
        st = os.stat(f"/proc/{pid}")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return False
    return st.st_uid == os.getuid() and b"sandbox.worker.daemon" in argv and name.encode() in argv


def stop(timeout: float = 10.0) -> list[dict]:
    """Stop every daemon of this user's: SIGTERM (it kills its workers, removes its socket and exits), then
    SIGKILL past `timeout`. Workers of calls still running die with it; those calls report a crash."""
    stopped = []
    where = directory()
    for entry in daemons():
        name, pid = entry["key"], entry["pid"]
        if not pid or not _is_daemon(pid, name):
            continue
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _lock_state(name, where)[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        if _lock_state(name, where)[0] and _is_daemon(pid, name):
            from sandbox.confinement import proctree

            proctree.kill_tree(pid)
        stopped.append({"key": name, "pid": pid})
    return stopped
