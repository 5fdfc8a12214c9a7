"""Worker processes: spawned fresh, spoken to over private pipes, killed with their whole group.

A worker is forked from a template process where this process has one (sandbox.confinement.template),
and otherwise started by exec. The parent (CLI, MCP server, harness) never imports the candidate's code
or torch for judging.

Apart: the pool of ready workers (sandbox/confinement/warm_pool.py; which pool a process keeps is decided here,
with the session that takes from it), the ending of workers (reaper.py) and what a worker is given (environment.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sandbox.backend import cuda_visible_devices, device_for, on_gpu
from sandbox.confinement import daemon, filesystem, proctree, template
from sandbox.confinement.environment import exchange_base, exchange_dir, shared_compile_cache, worker_env
from sandbox.confinement.limits import ResourceLimits, explain_death
from sandbox.confinement.reaper import REAPER

if TYPE_CHECKING:
    from sandbox.confinement.warm_pool import WarmPool

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
    def __init__(self, role: str, workdir: Path, env: dict[str, str] | None = None, compile_cache: bool = False):
        """`compile_cache`: a baseline may compile with the judge's persistent Inductor/Triton cache (granted only
        where shared caches are trusted, and only for a task from the library: see `library_task`)."""
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
            if self.proc is None:
                cmd = [sys.executable, "-P", "-m", "sandbox.worker", role, str(p2c_r), str(c2p_w)]
                self.proc = subprocess.Popen(cmd, pass_fds=(p2c_r, c2p_w), stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, cwd=workdir, env=env, start_new_session=True)
        self.forked = isinstance(self.proc, template.ForkedProcess)
        os.close(p2c_r)
        os.close(c2p_w)
        self._w = os.fdopen(p2c_w, "wb")
        self._r = c2p_r
        self._buf = b""
        self._early: list[dict] = []
        self._killed = False

    @property
    def ready_wait(self) -> float | None:
        """Seconds from asking for this worker to its being able to serve (torch imported, role taken)."""
        return None if self.ready_at is None else max(0.0, self.ready_at - self.requested_at)

    def send(self, op: str, **args) -> None:
        try:
            self._w.write(json.dumps({"op": op, **args}).encode() + b"\n")
            self._w.flush()
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
            return self._early.pop(0)
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.kill()
                    raise WorkerError("timeout", f"{what} did not finish within {timeout:.0f} s and was killed "
                                      "(an infinite loop, a deadlock, or a kernel that never returns?)")
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
                    self.kill()
                    raise WorkerError("internal_error", "the worker sent an oversized message")
            line, _, self._buf = self._buf.partition(b"\n")
            msg = json.loads(line)
            if self.ready_at is None and isinstance(msg, dict) and msg.keys() == {"ready_at"}:
                self.ready_at = float(msg["ready_at"])  # the worker's first line, before any reply
                if until_ready:
                    return {}
                continue
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
        limit = explain_death(rc, tail) if self.role != "reference" else None
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


_POOL: WarmPool | None = None

AUTO_POOL_ENV = "CUDA_AGENT_WARM_POOL"
# how this process has judged so far: a process on its second operation judges more than once, and keeps a pool
_AUTO: dict = {"sessions": 0, "live": {}, "enabled": True}
_AUTO_LOCK = threading.Lock()


def auto_pool_cap(warm_device: str) -> int:
    """How many ready workers per device a process that judges repeatedly may keep (CUDA_AGENT_WARM_POOL; 0: none).
    By default 24 on CUDA (eight judgments at a time keep eighteen: expect_judgments), where a worker's start is
    the device's initialisation (0.2-0.5 s alone, seconds under load), and none on the CPU, where a forked worker
    is ready in milliseconds and an idle one's start would only compete with a timing for the cores."""
    raw = os.environ.get(AUTO_POOL_ENV, "").strip()
    if raw:
        try:
            return max(0, int(raw))
        except ValueError:
            return 0
    return 24 if warm_device == "cuda" else 0


def one_shot() -> None:
    """This process judges once (a CLI command): no pool is started for it, whatever it spawns."""
    _AUTO["enabled"] = False


def start_daemon_early() -> None:
    """In a process with no template of its own, one-shot or not: the user's template daemon started now, not
    waited for, so that a build (5-40 s) covers its imports and the verify after it forks its workers. Asked for
    first by a verify, it started beside eight builds and the first workers waited 1.7-8.7 s for it
    (bench/results/judge_vi_round7_h100/); a CLI verify after a CLI compile started its workers by exec."""
    if template.mode() != "auto" or template.owned() is not None or template.attached():
        return
    try:
        daemon.channel(worker_env(), wait=False)
    except Exception:  # noqa: BLE001  (DaemonError and the like: the first worker then says why, as before)
        pass


def _pool_for(warm_device: str) -> WarmPool | None:
    """The pool a Session takes from: one enabled explicitly, or, from this process's second operation on, one
    that grows with the workers its operations hold at once."""
    key = (warm_device, cuda_visible_devices() or "")
    with _AUTO_LOCK:
        _AUTO["live"][key] = _AUTO["live"].get(key, 0) + 1
        if _POOL is not None and getattr(_POOL, "auto", False) and auto_pool_cap(warm_device) == 0:
            return None  # an automatic pool serves only the device kinds it is meant for (a CPU task check: none)
        if _POOL is None and _AUTO["enabled"] and _AUTO["sessions"] >= 2 and auto_pool_cap(warm_device) > 0:
            _auto_pool(auto_pool_cap(warm_device))
        if _POOL is not None and _POOL.refill:
            _POOL.grow(_AUTO["live"][key], warm_device)  # per GPU: a build over two GPUs holds half on each
        return _POOL


def _auto_pool(cap: int) -> WarmPool:
    """The process's automatic pool, made now if it has none (_AUTO_LOCK held)."""
    global _POOL
    if _POOL is None:
        from sandbox.confinement.warm_pool import WarmPool

        _POOL = WarmPool(min(2, cap), refill=True, cap=cap, worker=Worker)
        _POOL.auto = True
    return _POOL


def expect_judgments(at_once: int, backend: str, gpus: list[str] | None = None) -> WarmPool | None:
    """A process about to judge `at_once` workspaces at a time (a trainer's step, a bench, a synth filter): its pool
    now, in the background, sized for them (an automatic one appears at the second operation: the first wave of
    eight judgments on an H200 waited about 2 s for each worker). A judgment holds two workers at once and takes
    four: two per judgment are kept ready, and two more. `gpus`: the GPUs the judgments are spread over
    (GpuRing), each with a pool; None: as the environment says. None for a one-shot process or with no pool."""
    warm_device = device_for(backend)  # as a Session names its device
    cap = auto_pool_cap(warm_device)
    if at_once < 1 or cap == 0 or not _AUTO["enabled"]:
        return None
    with _AUTO_LOCK:
        pool = _auto_pool(cap)
    per_gpu = -(-at_once // max(1, len(gpus or [None])))
    for gpu in gpus or [None]:
        with on_gpu(gpu):
            pool.grow(2 * per_gpu + 2, warm_device)
    # the workers fork from a template that may still be importing torch: the caller goes on meanwhile (its builds)

    def fill() -> None:
        for gpu in gpus or [None]:
            with on_gpu(gpu):
                pool.prefill(warm_device)

    threading.Thread(target=fill, name="cuda-agent-prefill", daemon=True).start()
    return pool


def enable_warm_pool(size: int = 2, refill: bool = True, cap: int | None = None) -> WarmPool:
    """Keep `size` pre-started workers per device kind for this process's operations (growing to `cap`).

    refill=False: hand out the pre-started workers and start no replacements (a process that serves
    one operation, whose replacements would only compete with it for the CPU and be killed unused).
    """
    global _POOL
    if _POOL is None or _POOL.size != size or _POOL.refill != refill or (cap and _POOL.cap != cap):
        if _POOL is not None:
            _POOL.close()
        from sandbox.confinement.warm_pool import WarmPool

        _POOL = WarmPool(size, refill, cap, worker=Worker)
    return _POOL


def disable_warm_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.close()
    _POOL = None




class Session:
    """A private scratch directory plus the workers of one operation; everything dies on exit.

    `hold`: context managers entered with the session and left only after its workers are gone (in the
    background, see _Reaper); their values are `held`."""

    def __init__(self, warm_device: str = "cpu", hold: tuple = ()):
        self.dir = exchange_dir()
        self.workers: list[Worker] = []
        self.warm_device = warm_device
        self._hold = hold
        self._held = contextlib.ExitStack()
        self.held: list = []
        self._keys: list[tuple] = []  # the pool key of each worker spawned (the auto pool's count of what is held)
        with _AUTO_LOCK:
            _AUTO["sessions"] += 1

    def spawn(self, role: str, compile_cache: bool = False) -> Worker:
        # a pooled worker was confined at start like one that may run candidate code: it cannot reach the
        # persistent compile cache, so a baseline that may use that cache starts a process of its own
        compile_cache = compile_cache and role == filesystem.BASELINE_ROLE and filesystem.shared_caches_trusted()
        pool = _pool_for(self.warm_device)
        self._keys.append((self.warm_device, cuda_visible_devices() or ""))
        w = pool.take(role, self.warm_device) if pool is not None and not compile_cache else None
        if w is None:
            w = Worker(role, self.dir, compile_cache=compile_cache)
        self.workers.append(w)
        return w

    def hold(self, cm: contextlib.AbstractContextManager):
        """Enter `cm` now, held as the `hold` given at the start is: until this session's workers are gone."""
        value = self._held.enter_context(cm)
        self.held.append(value)
        return value

    def ready_waits(self) -> dict[str, float]:
        """Seconds from asking for each role's worker to its being ready ("<role>_wait"), and the longest of
        them ("worker_wait"), for the workers that have said so."""
        out: dict[str, float] = {}
        for w in self.workers:
            if w.ready_wait is not None:
                out[f"{w.role}_wait"] = max(out.get(f"{w.role}_wait", 0.0), w.ready_wait)
        if out:
            out["worker_wait"] = max(out.values())
        return out

    def __enter__(self) -> Session:
        try:
            self.held = [self._held.enter_context(cm) for cm in self._hold]
        except BaseException:
            self._held.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        return self

    def __exit__(self, *exc) -> None:
        with _AUTO_LOCK:
            for key in self._keys:
                _AUTO["live"][key] = _AUTO["live"].get(key, 1) - 1
        REAPER.submit(self.workers, self.dir, self._held)
