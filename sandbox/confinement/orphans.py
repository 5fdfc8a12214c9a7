"""Nothing left behind: a judging process that dies, of any signal, takes its workers and its folders with it.

Three parts (docs/judge-workers.md, "Nothing left behind"):
- Every process the judge starts by exec (a worker, a template) is started from a thread that lives as long as the
  judging process (`popen`) and asks the kernel for SIGKILL when that thread ends (PR_SET_PDEATHSIG, set by the
  worker itself: sandbox/worker/startup.py); a template's children ask for it when their template dies
  (sandbox/worker/template.py). SIGKILL, because a worker may be stopped (the timer is SIGSTOPped between a
  timing's phases) and a stopped process never acts on SIGTERM. The kernel sends the death signal when the
  *thread* that forked the child ends, not the process: a worker forked from a short-lived thread (a pool's
  prefill, a caller's thread pool) would be killed under a live judge, hence the one long-lived spawning thread.
- SIGTERM and SIGHUP, where the application left them at their default (it installs nothing of its own), kill
  the workers this process holds (`reap_now`: stopped ones too, since SIGKILL ends them), remove its folders, and
  then end the process of the same signal, as before. SIGINT stays Python's KeyboardInterrupt: the operations'
  own exits and the exit handlers end their workers then.
- SIGKILL runs nothing of ours: the workers die of their death signal, and the process's folder in the exchange
  area is removed by the next judging process's start-up sweep (sandbox/confinement/environment.py, `sweep`),
  which takes only folders whose owner's lock is free, so never a live judge's.
"""

from __future__ import annotations

import os
import queue
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from sandbox.confinement import proctree

# the judging process's pid, given to each process it starts by exec: the worker arms its death signal and then
# checks that this is still its parent (the judge may have died before the signal was armed)
JUDGE_PID_ENV = "CUDA_AGENT_JUDGE_PID"
HANDLED = (signal.SIGTERM, signal.SIGHUP)

_SPAWNER: dict = {"pid": None, "jobs": None}
_SPAWN_LOCK = threading.Lock()
_TRACKED: dict[int, Any] = {}  # id(worker) -> worker, until it is killed
_INSTALLED: dict = {"pid": None}


def judge_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a process this judge starts by exec, naming this process as the one it must die with."""
    return {**env, JUDGE_PID_ENV: str(os.getpid())}


def popen(*args, **kwargs) -> subprocess.Popen:
    """subprocess.Popen, forked from a thread that lives as long as this process: the main thread, or else one
    spawning thread (the death signal follows the forking thread)."""
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(*args, **kwargs)
    done, box = threading.Event(), {}
    _jobs().put((args, kwargs, box, done))
    done.wait()
    if "error" in box:
        raise box["error"]
    return box["proc"]


def _jobs() -> queue.SimpleQueue:
    with _SPAWN_LOCK:
        if _SPAWNER["pid"] != os.getpid():  # a forked copy of this process has no spawning thread: its own
            jobs: queue.SimpleQueue = queue.SimpleQueue()
            threading.Thread(target=_spawn_loop, args=(jobs,), name="cuda-agent-spawner", daemon=True).start()
            _SPAWNER.update(pid=os.getpid(), jobs=jobs)
        return _SPAWNER["jobs"]


def _spawn_loop(jobs: queue.SimpleQueue) -> None:
    while True:
        args, kwargs, box, done = jobs.get()
        try:
            box["proc"] = subprocess.Popen(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001  (handed to the caller, raised there)
            box["error"] = e
        finally:
            done.set()


def track(worker: Any) -> None:
    """A worker this process started (a Worker: `.proc.pid`): killed by `reap_now` until it is `untrack`ed."""
    _TRACKED[id(worker)] = worker


def untrack(worker: Any) -> None:
    _TRACKED.pop(id(worker), None)


def tracked() -> list[Any]:
    """The workers this process holds now (live, stopped, or being collected)."""
    return list(_TRACKED.values())


def tracked_pids() -> list[int]:
    return [w.proc.pid for w in tracked() if getattr(w, "proc", None) is not None]


# what else a signal's handler must end, registered by the modules that start it (sandbox/confinement/template.py:
# workers forked from a template are not this process's descendants); registered, not imported, since those modules
# import this one
_REAP_HOOKS: list[Callable[[], None]] = []


def on_reap(hook: Callable[[], None]) -> None:
    if hook not in _REAP_HOOKS:
        _REAP_HOOKS.append(hook)


def reap_now() -> None:
    """Kill every worker this process holds and remove its folders, now, taking no lock: called from a signal
    handler, which may interrupt the main thread holding any of them."""
    for pid in tracked_pids():
        proctree.kill_tree(pid)  # SIGSTOP, then SIGKILL: a stopped worker dies too
    for hook in list(_REAP_HOOKS):
        try:
            hook()
        except Exception:  # noqa: BLE001  (a handler on its way to the process's death: the rest still goes)
            pass
    from sandbox.confinement import environment

    folder = environment.current_process_folder()
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def _on_signal(sig: int, frame) -> None:
    try:
        reap_now()
    finally:
        # then the death this signal meant all along: its default action, with its exit status
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)


def install() -> bool:
    """Handle SIGTERM and SIGHUP in this process (`_on_signal`) where nothing else does (their disposition is the
    default). Only the main thread may install handlers: from another, nothing is done (the death signals and
    the start-up sweep still apply), and a later call from the main thread installs them. Whether installed."""
    if _INSTALLED["pid"] == os.getpid():
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in HANDLED:
        try:
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not the main interpreter
            return False
    _INSTALLED["pid"] = os.getpid()
    return True
