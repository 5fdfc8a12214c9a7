"""Sessions: the workers of one operation, where they come from, and their end.

A session's workers are forked from a template or started by exec (sandbox/confinement/worker_process.py), taken from
the process's pool of ready workers (warm_pool.py; which pool a process keeps is decided here), or, for the task's
side of a judgment, from the keeper of task processes (kept.py). They end with their session, off the caller's path
(reaper.py). The parent (CLI, MCP server, harness) never imports the candidate's code or torch for judging.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from typing import TYPE_CHECKING

from sandbox.backend import cuda_visible_devices, device_for, on_gpu
from sandbox.confinement import daemon, filesystem, judgment_uid, kept, relay, template
from sandbox.confinement.environment import count_setting, exchange_dir, worker_env
from sandbox.confinement.reaper import REAPER
from sandbox.confinement.worker_process import _AUTO, Worker, WorkerError, kill_tree

__all__ = ["REAPER", "Session", "Worker", "WorkerError", "expect_judgments", "kill_tree", "one_shot"]

if TYPE_CHECKING:
    from sandbox.confinement.warm_pool import WarmPool

_POOL: WarmPool | None = None

AUTO_POOL_ENV = "CUDA_AGENT_WARM_POOL"
_AUTO_LOCK = threading.Lock()


def auto_pool_cap(warm_device: str) -> int:
    """How many ready workers per device a process that judges repeatedly may keep (CUDA_AGENT_WARM_POOL; 0: none).
    By default 24 on CUDA (eight judgments at a time keep eighteen: expect_judgments), where a worker's start is
    the device's initialisation (0.2-0.5 s alone, seconds under load), and none on the CPU, where a forked worker
    is ready in milliseconds and an idle one's start would only compete with a timing for the cores."""
    return count_setting(AUTO_POOL_ENV, 24 if warm_device == "cuda" else 0)


def one_shot() -> None:
    """This process judges once (a CLI command): no pool is started for it, whatever it spawns."""
    _AUTO["enabled"] = False


def start_daemon_early() -> None:
    """In a process with no template of its own, one-shot or not: the user's template daemon started now, not
    waited for, so that a build (5-40 s) covers its imports and the verify after it forks its workers. Asked for
    first by a verify, it started beside eight builds and the first workers waited 1.7-8.7 s for it
    (3daac8d:bench/results/judge_vi_round7_h100/); a CLI verify after a CLI compile started its workers by exec."""
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
        # the real uid its workers share (sandbox/confinement/judgment_uid.py): fixed by a kept task process taken,
        # else at the first request a worker sends; None once fixed: they keep root's
        self.exchange_uid: int | None = None
        self._uid_binds, self._uid_fixed = judgment_uid.needed(warm_device), False
        with _AUTO_LOCK:
            _AUTO["sessions"] += 1

    def spawn(self, role: str, compile_cache: bool = False, keep: str | None = None, fresh: bool = False) -> Worker:
        """`keep`: the task's hash, for a task process (kept.KEEPABLE_ROLES) that a process judging repeatedly takes
        from, and gives back to, the keeper; `fresh`: never a kept one."""
        # the environment a process is started with is part of what it is (its limits, confinement, paths)
        key = (self.warm_device, cuda_visible_devices() or "", keep,
               hash((frozenset(worker_env().items()), os.environ.get("CUDA_AGENT_LIMITS", ""))) if keep else None)
        keep = keep if keep and role in kept.KEEPABLE_ROLES and _AUTO["enabled"] and kept.keep_cap(key[0]) else None
        w = kept.KEEPER.take(key) if keep and not fresh else None
        if w is not None and not self._adopt_uid(w):
            w.kill()  # kept under another judgment's uid than the one this session fixed (its workers asked first)
            w = None
        if w is not None:
            self.workers.append(w)
            return w
        # a pooled worker was confined at start like one that may run candidate code: it cannot reach the
        # persistent compile cache, so a baseline that may use that cache starts a process of its own
        compile_cache = compile_cache and role == filesystem.BASELINE_ROLE and filesystem.shared_caches_trusted()
        pool = _pool_for(self.warm_device)
        self._keys.append(key[:2])
        w = pool.take(role, self.warm_device) if pool is not None and not compile_cache else None
        if w is None:  # one that may be kept starts where its session's folder is not removed under it
            w = Worker(role, kept.KEEPER.dir if keep else self.dir, compile_cache=compile_cache,
                       device=self.warm_device)
        w.keep_key = key if keep else None
        if self._uid_binds:
            w.uid_source = self._judgment_uid
        self.workers.append(w)
        return w

    def _judgment_uid(self) -> int | None:
        if not self._uid_fixed:
            self.exchange_uid, self._uid_fixed = judgment_uid.acquire(), True
        return self.exchange_uid

    def _adopt_uid(self, w: Worker) -> bool:
        """A kept task process's uid becomes this session's, if the session has none yet; False if it has another."""
        if not self._uid_binds:
            return True
        if not self._uid_fixed:
            self.exchange_uid, self._uid_fixed = w.exchange_uid, True
            if w.exchange_uid is not None:
                judgment_uid.hold(w.exchange_uid)
            return True
        return self.exchange_uid == w.exchange_uid

    def replace(self, w: Worker) -> Worker:
        """A fresh process for a kept one that failed its first request (sandbox/correctness/task_process.py)."""
        w.kill()
        self.workers.remove(w)
        return self.spawn(w.role, keep=w.keep_key[2] if w.keep_key else None, fresh=True)

    def hold(self, cm: contextlib.AbstractContextManager):
        """Enter `cm` now, held as the `hold` given at the start is: until this session's workers are gone."""
        value = self._held.enter_context(cm)
        self.held.append(value)
        return value

    def ready_waits(self, names: dict[str, str] | None = None) -> dict[str, float]:
        """Seconds from asking for each role's worker to its being ready ("<role>_wait", or what `names` calls the
        role), and the longest of them ("worker_wait"), for the workers that have said so."""
        out: dict[str, float] = {}
        for w in self.workers:
            if w.ready_wait is not None:
                name = (names or {}).get(w.role, w.role)
                out[f"{name}_wait"] = max(out.get(f"{name}_wait", 0.0), w.ready_wait)
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
        # parked on the caller's path (a request, milliseconds), before the session's lock goes: the judgment's next
        # operation (its profile, after its verify) asks for the task's process at once, and finds it
        keep = [w for w in self.workers if kept.keepable(w)]
        for w in keep:
            relay.forget(w.placed)  # this judgment's files leave the task process with it
            kept.KEEPER.park(w)
        if self.exchange_uid is not None:  # after parking: a kept process's uid stays taken through it
            judgment_uid.release(self.exchange_uid)
        REAPER.submit([w for w in self.workers if w not in keep], self.dir, self._held)
