"""Workers forked from a template process instead of started by exec (the judge's side).

A worker started by exec imports torch and torch._dynamo before it serves (seconds). A template
(`python -P -m sandbox.worker template FD`, sandbox.worker.template) imports them once; each worker is
then a fork of it, ready in milliseconds. `Worker` (sandbox.confinement.processes) asks `fork_worker`
first and starts Python by exec when it answers None: no template wanted, or none that can fork.

Who has a template: `CUDA_AGENT_FORK=on` makes every judge process start one when it first needs a
worker; unset, only processes that ask (`enable`: the MCP server, long-lived API users) have one, and an
MCP helper uses its server's through a channel the server hands it (`new_channel_fd`, `attach`); any other
judge process (the CLI) forks from the user's template daemon (sandbox.confinement.daemon) once one is
ready; `CUDA_AGENT_FORK=off` starts every worker by exec. Standard library only: the template imports it too.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from sandbox.confinement import filesystem, proctree

FORK_ENV = "CUDA_AGENT_FORK"
CHANNEL_ENV = "CUDA_AGENT_TEMPLATE_FD"  # an MCP helper's channel to its server's template
# a template still importing answers late; one that has not answered in this time is treated as broken
FORK_TIMEOUT_S = 120.0
_MAX_MSG = 1 << 20
# set by each worker for itself (before anything reads them; see sandbox.worker.template): they may differ
# between a worker and the template; every other variable must be equal, since imports may read it
_CHILD_KEYS = frozenset({"CUDA_VISIBLE_DEVICES", *filesystem.scratch_env("/").keys()})


def import_env(env: dict[str, str]) -> dict[str, str]:
    """The part of a worker's environment that the template's imports saw: without the sandbox's own
    settings (read when used) and what each worker sets for itself."""
    return {k: v for k, v in env.items() if not (k.startswith("CUDA_AGENT_") or k in _CHILD_KEYS)}


def mode() -> str:
    value = os.environ.get(FORK_ENV, "").strip().lower()
    if value in ("off", "0", "no", "false", "exec"):
        return "off"
    return "on" if value in ("on", "1", "yes", "true", "fork") else "auto"


class TemplateError(Exception):
    def __init__(self, message: str, env: bool = False):
        super().__init__(message)
        self.env = env  # the worker's environment differs from the template's


class ForkedProcess:
    """What `Worker` uses of subprocess.Popen, for a child of the template. The template writes the
    child's exit status (Popen's returncode: negative for a signal) to a pipe, and keeps the child a
    zombie until `release()`, so that its pid names no other process while the judge may still kill it."""

    def __init__(self, pid: int, status_fd: int, channel: Channel):
        self.pid = pid
        self.returncode: int | None = None
        self.status_lost = False  # the template died first: the child's exit status is unknown
        self._fd = status_fd
        self._channel = channel
        try:
            self._pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            self._pidfd = -1
        _live.add(self)

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        rc = self._wait(timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
        return rc

    def _wait(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._fd >= 0:
                if not proctree.readable([self._fd], left):
                    return None
                data = os.read(self._fd, 64)
                _close(self._fd)
                self._fd = -1
                if data:
                    self.returncode = int(data)
                continue
            # the template is gone: the child, reparented, may still run; its pidfd says when it ends
            if self._pidfd >= 0 and not proctree.readable([self._pidfd], left):
                return None
            if self._pidfd < 0 and proctree.alive(self.pid):
                return None
            self.returncode, self.status_lost = 255, True
        return self.returncode

    def release(self) -> None:
        """The judge is done with the pid (killed and waited for): the template may reap it."""
        if self in _live:
            _live.discard(self)
            self._channel.send({"op": "reap", "pid": self.pid})
        for fd in (self._fd, self._pidfd):
            _close(fd)
        self._fd = self._pidfd = -1


class Channel:
    """One process's line to a template; requests and their replies, one at a time."""

    def __init__(self, sock: socket.socket, timeout: float = FORK_TIMEOUT_S):
        self.sock = sock
        self.lock = threading.Lock()
        self.broken: str | None = None
        self.timeout = timeout  # a template still importing answers late; the daemon listens only once ready

    def call(self, msg: dict, fds: tuple[int, ...] = (), timeout: float | None = None) -> dict:
        timeout = self.timeout if timeout is None else timeout
        with self.lock:
            if self.broken:
                raise TemplateError(self.broken)
            try:
                self.sock.settimeout(timeout)
                socket.send_fds(self.sock, [json.dumps(msg).encode()], list(fds))
                data = self.sock.recv(_MAX_MSG)
            except OSError as e:  # a timeout too: a late reply would answer the next request, so no more
                self.broken = f"the template did not answer ({type(e).__name__}: {e})"
                raise TemplateError(self.broken) from None
            if not data:
                self.broken = "the template process is gone"
                raise TemplateError(self.broken)
            return json.loads(data)

    def send(self, msg: dict) -> None:
        """A request that has no reply (a datagram: it never splits another request's exchange)."""
        try:
            self.sock.send(json.dumps(msg).encode())
        except OSError:
            pass

    def fork(self, role: str, cwd: str, env: dict[str, str], rfd: int, wfd: int, log_fd: int) -> ForkedProcess:
        status_r, status_w = os.pipe()
        try:
            r = self.call({"op": "fork", "role": role, "cwd": str(cwd), "env": env}, (rfd, wfd, log_fd, status_w))
        except TemplateError:
            _close(status_r)
            raise
        finally:
            _close(status_w)
        if "pid" not in r:
            _close(status_r)
            raise TemplateError(r.get("error", "no pid"), env=bool(r.get("env")))
        return ForkedProcess(r["pid"], status_r, self)

    def info(self, timeout: float | None = None) -> dict:
        return self.call({"op": "info"}, timeout=timeout)

    def close(self) -> None:
        self.broken = self.broken or "closed"
        self.sock.close()


class Template:
    """A template process started by this process: it dies when this process does (its control socket
    closes) and kills every worker it forked then."""

    def __init__(self, env: dict[str, str]):
        # in this process's folder of the exchange area: removed with it, by a signal's handler or, after a
        # SIGKILL, by the next judging process's sweep (sandbox/confinement/orphans.py); imported here, since the
        # template process imports this module and only the standard library
        from sandbox.confinement import orphans
        from sandbox.confinement.environment import process_folder

        orphans.on_reap(reap_for_signal)

        self.dir = tempfile.mkdtemp(prefix="cuda-agent-template-", dir=process_folder())
        # its imports see a TMPDIR and caches of its own, as an exec'd worker's see its scratch directory
        self.env = {**import_env(env), **filesystem.scratch_env(self.dir)}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log_path = os.path.join(self.dir, "template.log")
        with open(self.log_path, "wb") as log:
            # it dies with this process (its death signal, orphans.popen), and its children with it
            self.proc = orphans.popen([sys.executable, "-P", "-m", "sandbox.worker", "template", str(theirs.fileno())],
                                      pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, cwd=self.dir, env=orphans.judge_env(self.env),
                                      start_new_session=True)
        theirs.close()
        self.channel = Channel(ours)

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.channel.broken

    def matches(self, env: dict[str, str]) -> bool:
        return import_env(env) == import_env(self.env)

    def new_channel(self) -> socket.socket:
        """A channel for another process (its end is returned; pass it on, then close it here)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            socket.send_fds(self.channel.sock, [b'{"op": "channel"}'], [theirs.fileno()])
        finally:
            theirs.close()
        return ours

    def wait_ready(self, timeout: float) -> dict | None:
        """What the template says of itself once its imports are done, or None past `timeout`. Asked on a
        channel of its own: a slow import breaks only that channel, never the one this process forks through."""
        try:
            side = Channel(self.new_channel(), timeout=timeout)
        except OSError:
            return None
        try:
            return side.info()
        except TemplateError:
            return None
        finally:
            side.close()

    def close(self) -> None:
        self.channel.close()
        proctree.kill_tree(self.proc.pid)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


_lock = threading.Lock()
_own: Template | None = None
_attached: Channel | None = None
_live: set[ForkedProcess] = set()
_said: set[str] = set()


def _in_use(own: Template) -> bool:
    return any(p._channel is own.channel for p in _live)


def enable(env: dict[str, str]) -> Template:
    """Start this process's template now (it imports in the background), if it has none running. One
    imported under other environment values is replaced, but not while workers it forked are in use
    (closing it would kill them): until then it refuses such workers, which start by exec."""
    global _own
    with _lock:
        if _own is None or not _own.alive() or (not _own.matches(env) and not _in_use(_own)):
            if _own is not None:
                _own.close()
            _own = Template(env)
        return _own


def disable() -> None:
    global _own
    with _lock:
        if _own is not None:
            _own.close()
        _own = None


def owned() -> Template | None:
    return _own


def attached() -> bool:
    """Whether this process forks through a channel it inherited (an MCP helper's)."""
    return _attached is not None


def attach(fd: int) -> None:
    """Use the template behind this inherited channel (an MCP helper's, from its server)."""
    global _attached
    sock = socket.socket(fileno=fd)
    if sock.type != socket.SOCK_SEQPACKET:
        sock.detach()
        raise ValueError(f"fd {fd} is not a template channel")
    _attached = Channel(sock)


def new_channel_fd() -> int | None:
    """A channel to this process's template for a child process (the caller closes it once passed), or None."""
    if mode() == "off" or _own is None or not _own.alive():
        return None
    return _own.new_channel().detach()


def kill_children() -> None:
    """Kill every worker this process had forked and not yet released (a helper being stopped: they are
    not its descendants, so killing its own tree misses them)."""
    for p in list(_live):
        proctree.kill_tree(p.pid)


def fork_worker(role: str, cwd: str, env: dict[str, str], rfd: int, wfd: int, log_fd: int,
                daemon_channel: Callable[[dict[str, str]], Channel | None] | None = None) -> ForkedProcess | None:
    """A worker forked from the template, or None: start it by exec. `daemon_channel` (the judge's side passes
    sandbox.confinement.daemon.channel; the template process has no use for it) finds the user's template
    daemon for a process without a template of its own; it raises DaemonError where none may be used."""
    if mode() == "off":
        return None
    if _attached is not None:
        channel = _attached
    elif _own is not None or mode() == "on":
        channel = (_own if _own is not None and _own.alive() and _own.matches(env) else enable(env)).channel
    else:
        # no template of this process's: the user's template daemon, if one is ready
        if daemon_channel is None:
            return None
        try:
            found = daemon_channel(env)
        except Exception as e:  # DaemonError: no daemon may be used here
            _say(str(e))
            return None
        if found is None:  # none yet: this worker by exec, while one starts for later calls
            return None
        channel = found
    # the judge's side only: the template process forks nothing this way
    from sandbox.confinement import orphans

    orphans.on_reap(reap_for_signal)
    try:
        return channel.fork(role, cwd, env, rfd, wfd, log_fd)
    except TemplateError as e:
        _say(str(e))
        return None


def reap_for_signal() -> None:
    """What a judging process's SIGTERM or SIGHUP handler ends of the templates (sandbox/confinement/orphans.py):
    the workers forked for it (ours or the daemon's: not its descendants) and its own template with its folder."""
    kill_children()
    own = _own
    if own is not None:
        proctree.kill_tree(own.proc.pid)
        shutil.rmtree(own.dir, ignore_errors=True)


def _say(why: str) -> None:
    if why not in _said:  # said once per reason: every later worker falls back the same way
        _said.add(why)
        print(f"cuda-agent: starting workers by exec: {why}", file=sys.stderr, flush=True)


def _close(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass


atexit.register(disable)
