"""The user's template daemon: `python -P -m sandbox.worker.daemon LOCK_FD DIR KEY IDLE_S DEFER_PID`.

A template (sandbox.worker.template) that no judge owns: started detached by the first judge that found
none (sandbox.confinement.daemon, which explains the key and who may connect), it imports what every
worker needs, then listens on `DIR/KEY.sock` and forks workers for any judge of the same user and key,
one connection per judge process. It runs no task or candidate code and keeps one thread, exactly as the
template. When a connection closes (its judge finished, crashed or was killed) the workers forked
through it are killed. It exits, removing its socket, after IDLE_S seconds with no connection and no
worker, when its key no longer matches the code and torch on disk, and on SIGTERM (`cuda-agent
judge-daemon stop`). It holds LOCK_FD (an flock handed over by its starter) for as long as it lives.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable

# only once the call that started it is over, on a small machine (see PARALLEL_START_CPUS): standard library
# until then, since torch's import is the work being put off
STALE_CHECK_S = 10.0
DEFER_LIMIT_S = 120.0
MAX_REFUSED = 16
_MAX_MSG = 1 << 20


def _wait_for_exit(pid: int, limit: float) -> None:
    if pid <= 0:
        return
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # already gone
        return
    try:
        poller = select.poll()  # not select(): it cannot watch a descriptor numbered 1024 or above
        poller.register(fd, select.POLLIN)
        poller.poll(max(0, int(limit * 1000)))
    finally:
        os.close(fd)


def _log(msg: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} template daemon {os.getpid()}: {msg}", flush=True)


def main() -> None:
    lock_fd, where, name, idle, defer = (int(sys.argv[1]), sys.argv[2], sys.argv[3], float(sys.argv[4]),
                                         int(sys.argv[5]))
    # bound now, before the imports, so that a directory where no socket can be made costs no torch import
    os.umask(0o077)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.bind(os.path.join(where, f"{name}.sock.{os.getpid()}"))
    _wait_for_exit(defer, DEFER_LIMIT_S)
    sys.argv[1:] = ["template"]  # sandbox.worker.startup reads the role here: a template takes no worker's steps
    from sandbox.worker.__main__ import run_role

    daemon = _make(lock_fd, sock, where, name, idle, run_role)
    daemon.run()


def _make(lock_fd: int, sock: socket.socket, where: str, name: str, idle: float,
          run_role: Callable[[str, int, int], None]):
    from sandbox.confinement import daemon as judge_side
    from sandbox.confinement import proctree
    from sandbox.worker.template import _Template

    class Daemon(_Template):
        def __init__(self) -> None:
            super().__init__(None, run_role)
            self.own_fds |= {lock_fd, sock.fileno()}
            self.files = judge_side.paths(name, where)
            self.idle_s = idle
            self.busy_at = time.monotonic()
            self.checked_at = time.monotonic()
            self.stopping = False
            self.own = judge_side.traits()
            self.listener = sock
            self.refused: dict[socket.socket, bytes] = {}  # connection -> the answer to its every request
            self.info.update(daemon=name, idle_s=idle, connections=0, refused=0)

        def run(self) -> None:
            _log(f"importing (key {name})")
            try:
                self.preload()
            except Exception as e:  # answered as a problem: judges then start workers by exec
                self.info["problems"].append(f"the imports failed: {type(e).__name__}: {e}")
                self.import_fds = {}
            why = judge_side.unusable_here()
            if why:
                self.info["problems"].append(why)
            if self.out_of_date():
                self.exit("the code or torch changed during the imports")
            signal.signal(signal.SIGTERM, self.on_term)
            self.listen()
            _log(f"ready in {self.info.get('import_s', 0):.1f} s; problems: {self.info['problems'] or 'none'}")
            self.serve()

        def listen(self) -> None:
            """Bound under a temporary name and renamed into place once ready: a judge connects only to a
            daemon that is ready, and a dead daemon's socket file is replaced in one step."""
            self.listener.listen(64)
            self.listener.setblocking(False)
            os.rename(f"{self.files['sock']}.{os.getpid()}", self.files["sock"])
            self.sock_ino = os.stat(self.files["sock"]).st_ino
            self.watched = [self.listener]
            self.busy_at = time.monotonic()  # the idle time counts from being ready

        def on_term(self, *_) -> None:
            self.stopping = True  # the signal's wakeup byte ends the wait; tick() then exits

        def wait_s(self) -> float:
            left = self.idle_s - (time.monotonic() - self.busy_at)
            return max(0.2, min(5.0, left))

        def tick(self, ready: list) -> None:
            if self.stopping:
                self.exit("stopped (SIGTERM)")
            for conn in [c for c in ready if c in self.refused]:
                self.answer_refused(conn)
            if self.listener in ready:
                self.accept()
            now = time.monotonic()
            if self.conns or self.children:
                self.busy_at = now
            elif now - self.busy_at >= self.idle_s:
                self.exit(f"idle for {self.idle_s:g} s")
            if now - self.checked_at >= STALE_CHECK_S and not self.children:
                self.checked_at = now
                if self.out_of_date():
                    self.exit("out of date (the code or torch changed)")

        def accept(self) -> None:
            while True:
                try:
                    conn, _ = self.listener.accept()
                except (BlockingIOError, InterruptedError):
                    return
                conn.setblocking(True)
                why = judge_side.refusal(conn, self.own)
                if why:
                    self.info["refused"] += 1
                    _log(f"refused a connection: {why}")
                    self.refuse(conn, why)
                    continue
                self.conns.append(conn)
                self.info["connections"] = len(self.conns)

        def refuse(self, conn: socket.socket, why: str) -> None:
            """A refused connection is kept (a few at most) to answer each request with the reason: closed with
            a request unread, the peer would read a reset instead of any answer."""
            if len(self.refused) >= MAX_REFUSED:
                conn.close()
                return
            conn.setblocking(False)
            self.refused[conn] = json.dumps({"error": f"refused: {why}"}).encode()
            self.watched = [self.listener, *self.refused]

        def answer_refused(self, conn: socket.socket) -> None:
            try:
                while conn.recv(_MAX_MSG):
                    conn.send(self.refused[conn])
                gone = True  # an empty read: the peer closed
            except BlockingIOError:
                gone = False
            except OSError:
                gone = True
            if gone:
                del self.refused[conn]
                conn.close()
                self.watched = [self.listener, *self.refused]

        def closed(self, conn: socket.socket) -> None:
            super().closed(conn)
            self.info["connections"] = len(self.conns)

        def out_of_date(self) -> bool:
            try:
                return judge_side.key(self.env) != name
            except OSError:
                return True

        def exit(self, why: str) -> None:
            """Socket first (no judge connects to a daemon on its way out), then every worker, then the rest."""
            try:  # exiting before it was ready: still under its temporary name
                os.unlink(f"{self.files['sock']}.{os.getpid()}")
            except OSError:
                pass
            try:
                if os.stat(self.files["sock"]).st_ino == getattr(self, "sock_ino", None):
                    os.unlink(self.files["sock"])
            except OSError:
                pass
            for pid in list(self.children):
                proctree.kill_tree(pid)
            for pid in list(self.children):
                try:
                    os.waitpid(pid, 0)
                except ChildProcessError:
                    pass
            shutil.rmtree(self.files["tmp"], ignore_errors=True)
            _log(f"exiting: {why}")
            os._exit(0)

    return Daemon()


if __name__ == "__main__":
    main()
