"""The pool of ready workers: processes started ahead of need (torch imported, the device opened), each handed to
one operation's role once and killed with it like any worker.

Apart from sandbox/confinement/processes.py (the worker and the session that takes from this pool), which makes
the pool, handing it the worker class, and imports this module only when it does.
"""

from __future__ import annotations

import atexit
import contextlib
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandbox.backend import cuda_visible_devices
from sandbox.confinement.environment import count_setting, exchange_dir
from sandbox.confinement.limits import ResourceLimits

Worker = Any  # sandbox.confinement.processes.Worker, handed in (that module makes the pool: no import back)

# entered while a pool's workers open a device (create their CUDA context): sandbox.timing.device_lock registers the
# device's shared lock here when it is imported (it imports this layer, not the other way round)
_OPEN_GATE: list = [lambda device: contextlib.nullcontext()]
# contexts created in one shared hold: a timing that waits, waits for this many at most. One at a time: on an H200
# under eight judgments, four at once took 1.7 s (median) to open, one 0.7 s, and timings queued 2.2 s for the
# device against 2.8 s (docs/history.md, fourteenth round)
OPEN_BATCH_ENV, _OPEN_BATCH = "CUDA_AGENT_OPEN_BATCH", 1


def _open_batch() -> int:
    return max(1, count_setting(OPEN_BATCH_ENV, _OPEN_BATCH))


def gate_device_opens(gate) -> None:
    """`gate(device)`: the context manager a pool holds while its workers open `device`."""
    _OPEN_GATE[0] = gate


class WarmPool:
    """Worker processes started ahead of need: torch imported, the device initialised.

    Importing torch costs seconds (4 s seen on an H200 host), and each verify or profile needs fresh
    processes. A long-lived caller of the sandbox API (a training loop, the benchmarks) keeps a few started in the
    background; each is handed out once, for one operation, then killed like any worker, so no
    process ever runs two candidates. Only processes that have run no user code are pooled.

    `cap`: the pool grows (grow()) up to this many per device, following how many workers this process's
    operations hold at once: eight judgments at a time on one GPU take sixteen, and a pool of two would have
    left fourteen of them to start on demand, each paying the device's initialisation under load.
    """

    def __init__(self, size: int, refill: bool = True, cap: int | None = None, gated: tuple[str, ...] = ("cuda",), *,
                 worker: Callable[[str, Path], Worker]):
        """`gated`: the devices whose workers open them only when the pool's opener says so, a few at a time under
        the device's shared lock (_OPEN_GATE): a context created beside a timing stalled its batches for seconds
        (an H200, eight judgments: 4 of 24 profiles held the device 2.4-4.4 s for 0.05 s of timed calls)."""
        self.size = size
        self.cap = max(size, cap or size)
        self.sizes: dict[tuple, int] = {}  # per device, where grow() was told how many its operations hold
        self.refill = refill
        self.gated = gated
        self._worker = worker  # processes.Worker: (role, folder) -> a started worker
        self.dir = exchange_dir("cuda-agent-pool-")
        self.idle: dict[tuple, list[Worker]] = {}
        self.state: dict[int, str] = {}  # a gated worker's: "pending" (not yet told to open), "opening", "open"
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._opener: threading.Thread | None = None
        self._closed = False
        self.auto = False  # started by _pool_for, not by the process's owner
        atexit.register(self.close)

    def _start_one(self, key: tuple, warm_device: str) -> Worker:
        """A new idle worker (self._lock held); a gated one waits for the opener."""
        if warm_device not in self.gated:
            return self._worker(f"idle:{warm_device}", self.dir)
        w = self._worker(f"idle:{warm_device}:gated", self.dir)
        self.state[id(w)] = "pending"
        if self._opener is None:
            self._opener = threading.Thread(target=self._open_loop, name="cuda-agent-opener", daemon=True)
            self._opener.start()
        self._changed.notify_all()
        return w

    def _open_loop(self) -> None:
        """Opens pending workers' devices, _OPEN_BATCH at a time, each batch under one hold of _OPEN_GATE."""
        from sandbox.backend import on_gpu

        while True:
            with self._lock:
                while not self._closed and not any(self.state.get(id(w)) == "pending"
                                                   for ws in self.idle.values() for w in ws):
                    self._changed.wait()
                if self._closed:
                    return
                key = next(k for k, ws in self.idle.items() if any(self.state.get(id(w)) == "pending" for w in ws))
            with on_gpu(key[1] or None), _OPEN_GATE[0](key[0]):
                with self._lock:  # taken under the hold: a worker handed out meanwhile is no longer ours to open
                    batch = [w for w in self.idle.get(key, []) if self.state.get(id(w)) == "pending"][:_open_batch()]
                    for w in batch:
                        self.state[id(w)] = "opening"
                sent = []
                for w in batch:
                    try:
                        w.send("open")
                        sent.append(w)
                    except Exception:  # noqa: BLE001  (WorkerError: it died)
                        self._drop(key, w)
                for w in sent:
                    try:
                        ok = "opened_at" in w.recv(120.0, "opening the device")
                    except Exception:  # noqa: BLE001  (WorkerError; ValueError: killed meanwhile by close())
                        ok = False
                    if not ok:
                        self._drop(key, w)
                        continue
                    with self._lock:  # from here on it may be handed out: never touched by the opener again
                        self.state[id(w)] = "open"
                        self._changed.notify_all()

    def _drop(self, key: tuple, w: Worker) -> None:
        """A worker that failed to open its device leaves the pool (no one else has it: it was being opened)."""
        with self._lock:
            self.state.pop(id(w), None)
            with contextlib.suppress(ValueError):
                self.idle.get(key, []).remove(w)
            self._changed.notify_all()
        w.kill()

    def _pick(self, ready: list[Worker]) -> Worker | None:
        """An open worker first, then one the opener has not reached (it opens the device in its role's set-up);
        when every one is being opened, the first to open, waited for (self._lock held; None after 30 s)."""
        deadline = time.monotonic() + 30.0
        while ready:
            for want in ("open", "pending"):
                for w in ready:
                    if self.state.get(id(w), "open") == want:  # an ungated worker is ready as it is
                        ready.remove(w)
                        self.state.pop(id(w), None)
                        return w
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                return None
            self._changed.wait(left)
        return None

    def _key(self, warm_device: str) -> tuple:
        # the limits too: a worker takes its limits at its start, so one started under other limits serves none of
        # this operation's (on the H200 a memory bomb under a 4 GiB limit ran in a pooled worker started with the
        # default one, and was not stopped)
        return (warm_device, cuda_visible_devices() or "", ResourceLimits.from_env().to_env())

    def grow(self, wanted: int, warm_device: str | None = None) -> None:
        """At least `wanted` ready (at most `cap`): for one device (a GPU of the host), or for every one."""
        if warm_device is None:
            self.size = min(self.cap, max(self.size, wanted))
            return
        key = self._key(warm_device)
        self.sizes[key] = min(self.cap, max(self.sizes.get(key, self.size), wanted))

    def _size(self, key: tuple) -> int:
        return self.sizes.get(key, self.size)

    def prefill(self, warm_device: str) -> None:
        """Start the pool's processes now rather than at the first operation."""
        with self._lock:
            key = self._key(warm_device)
            ready = self.idle.setdefault(key, [])
            while len(ready) < self._size(key):
                ready.append(self._start_one(key, warm_device))

    def take(self, role: str, warm_device: str) -> Worker | None:
        key = self._key(warm_device)
        with self._lock:
            ready = self.idle.setdefault(key, [])
            w = self._pick(ready)
            while self.refill and len(ready) < self._size(key):
                ready.append(self._start_one(key, warm_device))
        if w is None or w.proc.poll() is not None:
            return None
        w.requested_at = time.monotonic()
        try:
            r = w.request("become", 60.0, "starting a worker", role=role)
        except Exception:  # noqa: BLE001  (WorkerError: it died or overran)
            w.kill()
            return None
        if not r.get("ok"):
            w.kill()
            return None
        w.role = role
        return w

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            for ws in self.idle.values():
                for w in ws:
                    w.kill()
            self.idle.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
