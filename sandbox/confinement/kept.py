"""Task processes kept between judgments: the task's side of a judgment (the `eager` role, verify's reference and
profile's eager) served again for the next judgment of the same task on the same device.

Why: every judgment started four processes, and on a GPU each creates a CUDA context, which the driver creates one
after another. On an H200 with eight judgments at a time a context took 2-5 s to open, and the verifies waiting for
theirs held the device's shared lock meanwhile (3daac8d:bench/results/judge_vi_opens_2026-11-28/). The candidate's two
processes stay fresh; the task's side is kept, which halves the contexts and skips the task's start-up.

Why it is safe (docs/judge.md, "Task processes kept between judgments"):
- Only a process that never ran candidate code is kept: the `eager` role loads no extension and no model_new.py.
- What a candidate reaches it with is data: output descriptors that it opens read-only and drops after the compare.
- It is kept only after a judgment in which every request to it was answered, and answered ok; `park` drops the
  judgment's model, inputs, outputs and spot copies and gives the device memory back, and its reply must show at most
  MAX_ALLOCATED bytes left allocated and no profiler running.
- The key is the hash of the task's text, which the judge reads once and sends: the process runs that text, never a
  file a client could swap meanwhile, so two tasks never share one.
- A kept process that fails its first request is replaced by a fresh one (sandbox/correctness/task_process.py): a
  fault on the device it met while idle is never a later judgment's verdict.
- Retired after MAX_USES judgments, past half of any of its limits (CPU seconds, data segment, descriptors), or idle
  for long.
"""

from __future__ import annotations

import atexit
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from sandbox.confinement.environment import count_setting, exchange_dir

KEEP_ENV = "CUDA_AGENT_KEEP_TASK_PROCESSES"
KEEPABLE_ROLES = ("eager",)  # roles that never load candidate code
MAX_USES = 64
IDLE_S = 300.0
MAX_FDS = 256
LIMIT_SHARE = 0.5  # of its CPU-seconds and descriptor limits a kept process may have used
DATA_SHARE = 0.75  # of its data-segment limit: a process starts with some (torch, the CUDA runtime), and it grows
MAX_ALLOCATED = 64 << 20  # device bytes a parked process may still hold (a library's workspace), not a model's


def keep_cap(warm_device: str) -> int:
    """How many idle task processes a process that judges repeatedly keeps per device (CUDA_AGENT_KEEP_TASK_PROCESSES;
    0: none). By default 12 on CUDA, where each saves a context's creation, and none on the CPU, where a forked
    process is ready in milliseconds."""
    return count_setting(KEEP_ENV, 12 if warm_device == "cuda" else 0)


class TaskKeeper:
    def __init__(self):
        self._lock = threading.Lock()
        self.idle: dict[tuple, list[tuple[float, Any]]] = {}  # key -> [(parked at, worker)], the newest last
        self.uses: dict[int, int] = {}
        self.counts = {"kept": 0, "reused": 0, "retired": 0}
        self.retired: dict[str, int] = {}  # why, how many
        self.last_park: dict = {}
        self._dir: Path | None = None
        self._closed = False
        atexit.register(self.close)

    @property
    def dir(self) -> Path:
        """Where a task process that may be kept is started: a session's folder goes with its session."""
        with self._lock:
            if self._dir is None:
                self._dir = exchange_dir("cuda-agent-kept-")
            return self._dir

    def take(self, key: tuple) -> Any | None:
        """An idle process for `key`, the most recently parked (None: start one)."""
        gone = []
        with self._lock:
            gone = self._expired()
            ready = self.idle.get(key, [])
            w = None
            while ready:
                _, cand = ready.pop()
                # alive, and its scratch folder still there (a pool closed since removes the folders of the
                # processes it started, which a kept one may have come from)
                if cand.proc.poll() is None and os.path.isdir(cand.scratch):
                    w = cand
                    break
                gone.append(cand)
            if w is not None:
                self.counts["reused"] += 1
        for g in gone:
            self._retire(g)
        if w is not None:
            w.reused = True
            w.requested_at = w.ready_at = time.monotonic()
        return w

    def park(self, w: Any) -> None:
        """After its judgment: its state dropped and checked, then kept, or retired."""
        uses = self.uses.pop(id(w), 0) + 1
        try:
            r = w.request("park", 30.0, "parking the task's process")
        except Exception:  # noqa: BLE001  (WorkerError: it died or overran)
            r = {}
        why = retire_reason(r, uses)
        self.last_park = {k: v for k, v in r.items() if k != "message"} | ({"why": why} if why else {})
        if why:
            self._retire(w, why)
            return
        gone = []
        with self._lock:
            if self._closed:
                gone.append(w)
            else:
                self.uses[id(w)] = uses
                self.idle.setdefault(w.keep_key, []).append((time.monotonic(), w))
                self.counts["kept"] += 1
                gone += self._over_cap(w.keep_key)
        for g in gone:
            self._retire(g)

    def _expired(self) -> list:
        now, gone = time.monotonic(), []
        for key, ws in self.idle.items():
            gone += [w for at, w in ws if now - at > IDLE_S]
            self.idle[key] = [(at, w) for at, w in ws if now - at <= IDLE_S]
        return gone

    def _over_cap(self, key: tuple) -> list:
        """The oldest idle processes past the cap of `key`'s device (self._lock held)."""
        device = key[:2]
        same = sorted(((at, k, w) for k, ws in self.idle.items() if k[:2] == device for at, w in ws),
                      key=lambda x: x[0])
        extra = max(0, len(same) - keep_cap(key[0]))
        gone = []
        for _, k, w in same[:extra]:
            self.idle[k] = [(at, x) for at, x in self.idle[k] if x is not w]
            gone.append(w)
        return gone

    def _retire(self, w: Any, why: str = "cap or idle") -> None:
        """Killed now; collected off the caller's path (a CUDA process takes 0.1-0.3 s to die)."""
        self.uses.pop(id(w), None)
        self.counts["retired"] += 1
        self.retired[why] = self.retired.get(why, 0) + 1
        w.stop()
        threading.Thread(target=w.kill, name="cuda-agent-retire", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            gone = [w for ws in self.idle.values() for _, w in ws]
            self.idle.clear()
            self._closed = True
            folder, self._dir = self._dir, None
        for w in gone:
            self._retire(w, "closed")
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def retire_reason(park: dict, uses: int) -> str | None:
    """Why a parked process may not be kept (its park reply `park`, its judgments so far `uses`), or None."""
    used = park.get("limits_used") or {}
    checks = (("park failed", not park.get("ok")),
              ("device memory left", park.get("allocated_bytes", MAX_ALLOCATED + 1) > MAX_ALLOCATED),
              ("profiler running", park.get("profiling", True)),
              ("CPU seconds", (used.get("cpu") or 0.0) >= LIMIT_SHARE),
              ("host memory", (used.get("data") or 0.0) >= DATA_SHARE),
              ("descriptors", (used.get("fds") or 0.0) >= LIMIT_SHARE or (park.get("open_fds") or 0) >= MAX_FDS),
              ("uses", uses >= MAX_USES))
    return next((why for why, bad in checks if bad), None)


KEEPER = TaskKeeper()


def keepable(w: Any) -> bool:
    """Whether a finished judgment's worker goes to the keeper: a task process, alive, every request to it answered
    and answered ok."""
    return (getattr(w, "keep_key", None) is not None and w.role in KEEPABLE_ROLES and w.clean
            and not w.outstanding and not w._killed and w.proc.poll() is None)
