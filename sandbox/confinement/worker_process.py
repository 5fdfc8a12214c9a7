"""A worker process: spawned fresh, spoken to over a private pipe, killed with its whole group.

Forked from a template process where this process has one (sandbox.confinement.template), and otherwise started by
exec. Which workers an operation gets, and from where (a pool, the keeper of task processes), is decided by the
session that spawns them (sandbox/confinement/processes.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sandbox.confinement import daemon, filesystem, mountns, orphans, pidgroup, proctree, relay, template
from sandbox.confinement.environment import exchange_base, shared_compile_cache, worker_env
from sandbox.confinement.limits import ResourceLimits, explain_death

# how this process has judged so far: a process on its second operation judges more than once, and keeps a pool
_AUTO: dict = {"sessions": 0, "live": {}, "enabled": True}

_MAX_LINE = 64 << 20


def kill_tree(pid: int) -> None:
    """SIGKILL a process, every descendant, and their process groups.

    Process groups alone are not enough: ninja puts each compiler in a group of its own, and a
    candidate may call setsid().
    """
    proctree.kill_tree(pid)


class WorkerError(Exception):
    """A worker died or overran its time; `reason` is a results.Reason value."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


class Worker:
    # while a timing runs, the process that reads the judge's clock around its timed requests
    # (sandbox/timing/judge_clock.py); None: the judging thread reads it
    clock = None
    # the judgment's uid this process takes at its set-up (sandbox/confinement/judgment_uid.py): asked of
    # `uid_source` (its session) at its first request, sent with it once; a kept one keeps it
    exchange_uid: int | None = None
    uid_source = None
    _uid_sent = False

    def __init__(self, role: str, workdir: Path, env: dict[str, str] | None = None, compile_cache: bool = False,
                 device: str | None = None):
        """`compile_cache`: a baseline may compile with the judge's persistent Inductor/Triton cache (granted only
        where shared caches are trusted, and only for a task from the library: see `library_task`). `device`: the
        kind of device it will open ("cpu", "cuda"), where known: its start-up bounds its threads by it
        (sandbox.confinement.pidgroup.bind_rest)."""
        self.role = role
        # from when a worker was asked for to when it could serve (ready_wait): its first line says when
        self.requested_at = time.monotonic()
        self.ready_at: float | None = None
        log_fd, log_name = tempfile.mkstemp(prefix=f"{role.replace(':', '-')}-", suffix=".log", dir=workdir)
        self.log_path = Path(log_name)
        # the only directory (besides the exchange area) that a confined candidate may write
        self.scratch = tempfile.mkdtemp(prefix="scratch-", dir=workdir)
        env = dict(env or worker_env(), CUDA_AGENT_SCRATCH=self.scratch, CUDA_AGENT_EXCHANGE_BASE=exchange_base(),
                   CUDA_AGENT_LIMITS=ResourceLimits.from_env().to_env())
        env.pop(filesystem.COMPILE_CACHE_ENV, None)
        env.pop(pidgroup.DEVICE_ENV, None)
        if device:
            env[pidgroup.DEVICE_ENV] = device
        if compile_cache and role == filesystem.BASELINE_ROLE and filesystem.shared_caches_trusted():
            env[filesystem.COMPILE_CACHE_ENV] = shared_compile_cache()
        p2c_r, p2c_w = os.pipe()
        c2p_r, c2p_w = os.pipe()
        # mkstemp's own descriptor is the log's: reopening the path left it open, one per worker, until a long
        # judging process ran out of the numbers select() could watch
        with os.fdopen(log_fd, "wb") as log:
            self.proc: subprocess.Popen | template.ForkedProcess | None = template.fork_worker(
                role, str(workdir), env, p2c_r, c2p_w, log.fileno(),
                # a process that judges again waits for a starting daemon rather than start this worker by exec
                lambda e: daemon.channel(e, wait=_AUTO["enabled"]))
            if self.proc is None:  # started where it dies with this process (orphans.popen)
                cmd = [sys.executable, "-P", "-m", "sandbox.worker", role, str(p2c_r), str(c2p_w)]
                self.proc = orphans.popen(cmd, pass_fds=(p2c_r, c2p_w), stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=workdir, env=orphans.judge_env(env),
                                          start_new_session=True)
        self.forked = isinstance(self.proc, template.ForkedProcess)
        # killed with this process's other workers if it dies of a signal (sandbox/confinement/orphans.py)
        orphans.track(self)
        orphans.install()
        os.close(p2c_r)
        os.close(c2p_w)
        self._w = os.fdopen(p2c_w, "wb")
        self._r = c2p_r
        self._buf = b""
        self._early: list[dict] = []
        self._killed = False
        # a task process that may serve the next judgment of its task (kept.py): its key, whether it was kept, and
        # what decides whether it may be kept again: requests unanswered, and whether every reply was ok
        # its own /dev/shm's host path (it says so when ready), and the files the judge linked into it (relay.py)
        self.own_shm: str | None = None
        self.placed: list[str] = []
        self.keep_key: tuple | None = None
        self.reused = False
        self.outstanding = 0
        self.clean = True

    @property
    def ready_wait(self) -> float | None:
        """Seconds from asking for this worker to its being able to serve (torch imported, role taken)."""
        return None if self.ready_at is None else max(0.0, self.ready_at - self.requested_at)

    def send(self, op: str, **args) -> None:
        if self.exchange_uid is None and self.uid_source is not None:
            self.exchange_uid = self.uid_source()
        if self.exchange_uid is not None and not self._uid_sent:
            args["exchange_uid"], self._uid_sent = self.exchange_uid, True
        line = json.dumps({"op": op, **self.outgoing(args)}).encode() + b"\n"  # a link that fails is not a death
        try:
            self._w.write(line)
            self._w.flush()
            self.outstanding += 1
        except (BrokenPipeError, OSError):
            raise self._died(f"while sending {op}") from None

    def wait_ready(self, timeout: float, what: str) -> None:
        """Until the worker's first line (it can serve): a judgment waits for its workers before it takes the
        device's lock, not while holding it."""
        if self.ready_at is None:
            msg = self.recv(timeout, what, until_ready=True)
            if msg:  # a reply before the ready line (a worker that failed to start says why): kept for recv
                self._early.append(msg)

    def recv(self, timeout: float, what: str, until_ready: bool = False) -> dict:
        if self._early:
            return self._answered(self._early.pop(0))
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.overran(what, timeout)
                ready = proctree.readable([self._r], min(left, 1.0))
                if not ready:
                    if self.proc.poll() is not None:
                        raise self._died(what)
                    continue
                chunk = os.read(self._r, 1 << 20)
                if not chunk:
                    raise self._died(what)
                self._buf += chunk
                if len(self._buf) > _MAX_LINE:
                    raise self.oversized()
            line, _, self._buf = self._buf.partition(b"\n")
            msg = json.loads(line)
            if self.ready_at is None and isinstance(msg, dict) and msg.keys() <= {"ready_at", "private_shm"} \
                    and "ready_at" in msg:
                self.ready_at = float(msg["ready_at"])  # the worker's first line, before any reply (and candidate code)
                if msg.get("private_shm") is True:
                    self.own_shm = os.path.join(self.scratch, mountns.OWN_SHM)
                if until_ready:
                    return {}
                continue
            return msg if until_ready else self._answered(msg)  # an early reply: counted when recv takes it

    def outgoing(self, args: dict) -> dict:
        """A request's arguments as this worker must get them: files other workers exported linked into its own
        /dev/shm (sandbox/confinement/relay.py)."""
        return relay.deliver(args, self.own_shm, self.placed)

    def incoming(self, msg):
        """A reply of this worker, with the host path of each file it exported noted for the next reader."""
        return relay.mark(msg, self.own_shm)

    def _answered(self, msg: dict) -> dict:
        self.outstanding -= 1
        self.incoming(msg)
        if not (isinstance(msg, dict) and msg.get("ok", True)):
            self.clean = False
        return msg

    def request(self, op: str, timeout: float, what: str, **args) -> dict:
        self.send(op, **args)
        return self.recv(timeout, what)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-chars:].decode(errors="replace")

    def died(self, what: str) -> WorkerError:
        """The error for this worker's channel having ended during `what` (it is collected and killed)."""
        return self._died(what)

    def overran(self, what: str, timeout: float) -> WorkerError:
        """The error for `what` having taken longer than `timeout` seconds: the worker is killed."""
        self.kill()
        return WorkerError("timeout", f"{what} did not finish within {timeout:.0f} s and was killed "
                           "(an infinite loop, a deadlock, or a kernel that never returns?)")

    def oversized(self) -> WorkerError:
        """The error for a reply line past the reader's limit: the worker is killed."""
        self.kill()
        return WorkerError("internal_error", "the worker sent an oversized message")

    def _died(self, what: str) -> WorkerError:
        try:
            rc = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = self.proc.returncode
        tail = self.log_tail()
        if rc is not None and rc < 0:
            try:
                sig = signal.Signals(-rc).name
            except ValueError:
                sig = f"signal {-rc}"
            cause = f"the process was killed by {sig}"
        elif getattr(self.proc, "status_lost", False):
            cause = "the process ended after the template it was forked from, so its exit status is unknown"
        else:
            cause = f"the process exited with status {rc}"
        reason = "cuda_error" if "CUDA error" in tail or "cudaError" in tail else "crash"
        if "out of memory" in tail.lower():
            reason = "oom"
        self.kill()
        limit = explain_death(rc, tail) if self.role not in ("reference", "eager") else None  # the task's, not a candidate's
        if limit:
            return WorkerError(limit[0], f"{what}: {limit[1]}." + (f"\nlast output:\n{tail}" if tail.strip() else ""))
        return WorkerError(reason, f"{what}: {cause} (a segfault or illegal memory access in a kernel?)."
                           + (f"\nlast output:\n{tail}" if tail.strip() else ""))

    def stop(self) -> None:
        """SIGKILL the worker's tree now, collecting nothing: kill() later waits for it and cleans up."""
        if not self._killed:
            kill_tree(self.proc.pid)

    def kill(self) -> None:
        if self._killed:  # once: a forked worker's pid is released to the template after the first time
            return
        self._killed = True
        kill_tree(self.proc.pid)
        orphans.untrack(self)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self.forked:
            self.proc.release()
        shutil.rmtree(self.scratch, ignore_errors=True)
        for fd in (self._r,):
            try:
                os.close(fd)
            except OSError:
                pass
        self._r = -1
        try:
            self._w.close()
        except OSError:
            pass

    def close(self, timeout: float = 5.0) -> None:
        """Ask politely, then kill: a worker never outlives the operation that started it."""
        if self._r >= 0 and self.proc.poll() is None:
            try:
                self.request("exit", timeout, "exit")
            except WorkerError:
                pass
        self.kill()
