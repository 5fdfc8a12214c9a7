"""The template process workers are forked from: `python -P -m sandbox.worker template FD`.

Importing torch and torch._dynamo costs a worker seconds (4-5 s and 5-6 s on the H100 host). The template
pays that once per judge process, then only forks: each child is a worker that starts with everything
imported, and takes the same start-up steps as a freshly executed one (`_child`). The template never
opens a device, starts no thread, and runs no task or candidate code; it serves no role itself. What
it may do is fixed by the requests of the judge that started it (see sandbox.confinement.template for
that side, and docs/judge.md, "Workers forked from a template", for why no state crosses from one
child to another).

Requests come as datagrams on unix sockets (SOCK_SEQPACKET, so each is one message, with its file
descriptors attached): on the control socket the judge that started it may also hand over a new
channel for another process (an MCP helper); on any socket: `fork` (fds: the worker's two protocol
pipes, its log, and a pipe for its exit status), `reap` and `info`. When a channel closes, its
children are killed; when the control socket closes, all are, and the template exits. The per-user
daemon (sandbox.worker.daemon) is this template with no control socket: it listens on a path instead.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

from sandbox.confinement import proctree
from sandbox.confinement.template import import_env
from sandbox.worker import startup

_MAX_MSG = 1 << 20
# what every role imports, so that no child imports it; not sandbox.worker.timer (nor baseline_timer and
# synth_probe, which import it): it asks torch whether CUDA is available at import, initialising CUDA
PRELOAD = ("torch._dynamo", "torch.profiler", "torch.autograd.profiler", "sandbox.worker.protocol",
           "sandbox.worker.candidate", "sandbox.worker.reference", "sandbox.worker.check",
           "sandbox.worker.kernel_audit", "sandbox.worker.op_audit", "sandbox.timing.timing_bound")
NOT_IMPORTED = ("sandbox.worker.timer",)


class _Child:
    def __init__(self, conn: socket.socket, status_fd: int):
        self.conn = conn
        self.status_fd = status_fd  # closed once the exit status is written
        self.released = False  # the judge is done with the pid: reap it once it has exited


class _Template:
    def __init__(self, control: socket.socket | None, run_role: Callable[[str, int, int], None]):
        # None for the per-user daemon (sandbox.worker.daemon): no judge owns it, it listens instead
        self.control = control
        self.run_role = run_role
        self.conns = [control] if control is not None else []
        self.watched: list = []  # more descriptors for the loop to wait on (the daemon's listening socket)
        # descriptors of the template's own, opened before the imports: never a child's
        self.own_fds: set[int] = {control.fileno()} if control is not None else set()
        self.children: dict[int, _Child] = {}
        self.forks = 0
        self.env = dict(os.environ)
        self.info: dict = {"pid": os.getpid(), "problems": []}
        self.import_fds: dict[int, str] = {}

    # ---- start-up ---------------------------------------------------------------------------
    def preload(self) -> None:
        import importlib

        t0 = time.perf_counter()
        for name in PRELOAD:
            t = time.perf_counter()
            importlib.import_module(name)
            self.info[f"import_{name}_s"] = time.perf_counter() - t
        self.info["import_s"] = time.perf_counter() - t0 + (startup._TORCH_IMPORTED - startup._STARTED)
        self.info["import_torch_s"] = startup._TORCH_IMPORTED - startup._STARTED
        # descriptors the imports opened (the process started with the standard streams and the control socket)
        self.import_fds = {fd: p for fd, p in _open_fds().items() if fd > 2 and fd not in self.own_fds}
        # a fork that does nothing: libraries that stop their threads before a fork (numpy's OpenBLAS starts
        # one when loaded) stop them now, so that the template then has one thread, as checked below
        t = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        self.info["fork_ms"] = (time.perf_counter() - t) * 1e3
        self.info["problems"] = self.check()

    def check(self) -> list[str]:
        """Why children of this process could not be workers (nothing, normally): a thread (its locks and its
        work are not in the child), CUDA initialised or a device file open (a child of a process that
        initialised CUDA cannot use it), or a module imported that must not be."""
        problems = []
        threads = os.listdir("/proc/self/task")
        self.info["threads"] = len(threads)
        if len(threads) != 1:
            names = sorted(_comm(t) for t in threads)
            problems.append(f"{len(threads)} threads after the imports ({', '.join(names)})")
        if torch.cuda.is_initialized():
            problems.append("CUDA was initialised during the imports")
        devices = sorted({p for p in self.import_fds.values() if p.startswith("/dev/nvidia")})
        if devices:
            problems.append(f"device files open after the imports: {', '.join(devices)}")
        sockets = sorted({p for p in self.import_fds.values() if p.startswith("socket:")})
        if sockets:  # children keep what the imports opened: no socket may be among it
            problems.append(f"sockets open after the imports: {', '.join(sockets)}")
        problems += [f"{m} was imported" for m in NOT_IMPORTED if m in sys.modules]
        self.info["import_fds"] = sorted(self.import_fds.values())
        self.info["modules"] = {m: m in sys.modules for m in ("torch", "torch._dynamo", *NOT_IMPORTED)}
        return problems

    # ---- the loop ---------------------------------------------------------------------------
    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to the wakeup pipe
        self.wake = (wake_r, wake_w)
        while True:
            ready = proctree.readable(self.conns + self.watched + [wake_r], self.wait_s())
            if wake_r in ready:
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
            self.collect()
            self.tick(ready)
            for conn in [c for c in ready if c in self.conns]:
                try:
                    msg, fds, _, _ = socket.recv_fds(conn, _MAX_MSG, 8)
                except OSError:
                    msg, fds = b"", []
                if not msg:
                    self.closed(conn)
                    continue
                try:
                    self.handle(conn, json.loads(msg), fds)
                except Exception as e:  # a malformed request: answered, never fatal to the template
                    _reply(conn, {"error": f"{type(e).__name__}: {e}"})
                finally:
                    for fd in fds:
                        _close(fd)

    def wait_s(self) -> float | None:
        """How long the loop may wait for a request (the daemon wakes to check its idle time)."""
        return None

    def tick(self, ready: list) -> None:
        """Called on every wake-up, before requests are read (the daemon accepts connections here)."""

    def handle(self, conn: socket.socket, msg: dict, fds: list[int]) -> None:
        op = msg.get("op")
        if op == "channel" and conn is self.control and len(fds) == 1:
            self.conns.append(socket.socket(fileno=os.dup(fds[0])))
        elif op == "reap":
            child = self.children.get(msg.get("pid"))
            if child is not None and child.conn is conn:
                child.released = True
                self.collect()
        elif op == "info":
            _reply(conn, {**self.info, "children": len(self.children), "forks": self.forks})
        elif op == "fork" and len(fds) == 4:
            _reply(conn, self.fork(conn, msg, fds))
        else:
            _reply(conn, {"error": f"bad request {op!r}"})

    def fork(self, conn: socket.socket, msg: dict, fds: list[int]) -> dict:
        if self.info["problems"]:
            return {"error": "the template cannot fork workers: " + "; ".join(self.info["problems"])}
        wanted, own = import_env(msg["env"]), import_env(self.env)
        differs = sorted(k for k in wanted.keys() | own.keys() if wanted.get(k) != own.get(k))
        if differs:
            # torch and the libraries it loads read these when they are imported: a worker needs a template
            # that imported them under the same values
            return {"error": f"the environment differs from the template's in {', '.join(differs[:5])}", "env": True}
        started = time.perf_counter()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            # dies (SIGKILL) with the template, stopped or not: a template dies with its judge (its control socket
            # closes, or its own death signal) and its children must not outlive it (sandbox/confinement/orphans.py)
            if not proctree.die_with(parent):
                os._exit(1)
            self.child(msg, fds, started)  # never returns
        self.children[pid] = _Child(conn, os.dup(fds[3]))
        self.forks += 1
        return {"pid": pid}

    def child(self, msg: dict, fds: list[int], started: float) -> None:
        """The forked worker, in order: drop everything of the template's; become a process of its own the
        way `subprocess` would make it (session, standard streams, working directory, environment); then
        the worker's own start-up (network namespace, Landlock's first stage) while it has one thread; then
        its role. It never returns into the template's loop."""
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the daemon's handler: a worker dies of it as always
            rfd, wfd, log_fd, _status = fds
            os.setsid()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log_fd, 1)
            os.dup2(log_fd, 2)
            # the template's sockets (no child may ask it for anything), the daemon's lock, the other children's
            # exit-status pipes, the wakeup pipe: only the worker's own pipes stay open, and what the imports opened
            keep = {0, 1, 2, rfd, wfd} | set(self.import_fds)
            for fd in _open_fds():
                if fd not in keep:
                    _close(fd)
            os.chdir(msg["cwd"])
            os.environ.clear()
            os.environ.update(msg["env"])
            _forget_import_time_paths()
            role = msg["role"]
            sys.argv[1:] = [role, str(rfd), str(wfd)]
            startup.forked(role, started)
            self.run_role(role, rfd, wfd)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(1)

    def collect(self) -> None:
        """Write each exited child's status to its pipe, keeping it a zombie (so its pid cannot be reused
        while the judge may still signal it) until the judge releases it."""
        for pid, child in list(self.children.items()):
            if child.status_fd >= 0:
                try:
                    r = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                except ChildProcessError:
                    r = None
                    del self.children[pid]
                    continue
                if r is None:
                    continue
                rc = r.si_status if r.si_code == os.CLD_EXITED else -r.si_status
                try:
                    os.write(child.status_fd, f"{rc}\n".encode())
                except OSError:  # the judge no longer listens
                    pass
                _close(child.status_fd)
                child.status_fd = -1
            if child.released:
                os.waitpid(pid, 0)
                del self.children[pid]

    def closed(self, conn: socket.socket) -> None:
        """A channel's process is gone (done, killed, or crashed): its workers die with it."""
        for pid, child in self.children.items():
            if child.conn is conn or conn is self.control:
                proctree.kill_tree(pid)
                child.released = True
        self.collect()
        if conn is self.control:
            os._exit(0)
        self.conns.remove(conn)
        conn.close()


def _reply(conn: socket.socket, obj: dict) -> None:
    try:
        conn.send(json.dumps(obj).encode())
    except OSError:
        pass


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _open_fds() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed already
            pass
    return out


def _comm(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return tid


def _forget_import_time_paths() -> None:
    """Values computed from the template's environment or working directory when a module was imported,
    which a worker started by exec would have computed from its own: computed again now."""
    tempfile.tempdir = None
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        mp_process.ORIGINAL_DIR = os.path.abspath(os.getcwd())
    dynamo_config = sys.modules.get("torch._dynamo.config")
    if dynamo_config is not None:
        dynamo_config.debug_dir_root = dynamo_config.default_debug_dir_root()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # seeded from the OS when imported: each exec'd worker had its own draw
        numpy.random.seed(int.from_bytes(os.urandom(4), "little"))


def serve_forks(control_fd: int, run_role: Callable[[str, int, int], None]) -> None:
    template = _Template(socket.socket(fileno=control_fd), run_role)
    try:
        template.preload()
    except Exception:  # answered as a problem: the judge then starts workers by exec
        template.info.setdefault("problems", []).append("the imports failed:\n" + traceback.format_exc()[-2000:])
        template.import_fds = {}
    sys.stdout.flush()
    template.serve()
