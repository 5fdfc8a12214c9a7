"""Filter by execution: each task runs in an isolated worker (`synth_probe` role), never here.

Tasks are spread over `jobs` worker slots; on CUDA each slot is pinned to one GPU
(CUDA_VISIBLE_DEVICES), slot i on GPU i mod n, so one host's GPUs are used together. A slot's worker probes
up to `per_worker` tasks in turn (torch.compile's start in a process is paid once, not per task); a task's
crash or hang ends its worker, and a drop that an earlier task in the same worker could have caused (a
crash, a timeout, running out of memory, a failure to run or to compile) is decided again in a fresh process,
so a verdict never depends on which tasks shared a worker. `per_worker=1`: a fresh process for every task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from synth.slots import Faults, run_slots

# eager time per task: the paper's 1-100 ms on a GPU; CPU tasks are small, so a band of their own
DEFAULT_BAND_MS = {"cuda": (1.0, 100.0), "cpu": (0.01, 1000.0)}


@dataclass
class FilterConfig:
    backend: str = "cpu"
    band_ms: tuple[float, float] | None = None
    jobs: int = 1
    gpus: list[int] | None = None   # None: every visible GPU (cuda backend)
    compile: bool = True
    atol: float = 1e-2
    rtol: float = 1e-2
    timeout_s: float = 600.0
    per_worker: int = 8  # tasks one worker probes in turn (1: a fresh process per task; Ray's actors: always 1)
    ray: str | None = None  # probe on a Ray cluster's judge actors (harness.cluster), `jobs` at once per actor

    def band(self) -> tuple[float, float]:
        return self.band_ms or DEFAULT_BAND_MS[self.backend]


def _gpu_list(cfg: FilterConfig) -> list[str]:
    if cfg.backend != "cuda":
        return [""]
    if cfg.gpus is not None:
        return [str(g) for g in cfg.gpus]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [v for v in visible.split(",") if v.strip()]
    import subprocess

    # counted without importing torch here: this process never initialises CUDA
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        n = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    except (OSError, subprocess.SubprocessError):
        n = 0
    return [str(i) for i in range(max(n, 1))]


# no upper edge: what a probe beside others on its device may read above the band
UNBOUNDED_MS = 1e12


def shared_device_band(cfg: FilterConfig) -> FilterConfig:
    """The band a probe applies when other probes share its device: only the lower edge. Their work only slows
    its eager time, so a reading below the band is a task below it, but a reading above may be a task inside it:
    on two H100s with eight probes each, the gate (which times alone on the device) read eager at a median 7x
    below the probes, and the filter had dropped 753 of 2,400 candidates as over 100 ms. The gate applies the
    upper edge."""
    return dataclasses.replace(cfg, band_ms=(cfg.band()[0], UNBOUNDED_MS))


def _probe_args(cfg: FilterConfig) -> dict:
    """The synth_probe role's arguments besides the task, the same for a fresh worker and a kept one."""
    return dict(device="cuda" if cfg.backend == "cuda" else "cpu", band_ms=list(cfg.band()), atol=cfg.atol,
                rtol=cfg.rtol, compile=cfg.compile)


def probe_one(source: str, cfg: FilterConfig, gpu: str) -> dict:
    """One task in a fresh `synth_probe` worker on `gpu`: a Session's, so that a build that probes many tasks
    takes its workers ready (device initialised) from the process's pool, keyed by GPU (issue 37, item 1), and
    their teardown happens off this thread (sandbox/confinement/reaper.py). metrics: the probe's own seconds and
    the wait for its worker, beside the role's (eager_ms, compile_s)."""
    from contextlib import nullcontext

    from sandbox.backend import on_gpu
    from sandbox.confinement.processes import Session, WorkerError

    t0 = time.perf_counter()
    with on_gpu(gpu) if gpu else nullcontext(), Session("cuda" if cfg.backend == "cuda" else "cpu") as s:
        w = s.spawn("synth_probe")
        path = os.path.join(w.scratch, "task.py")  # the worker's own folder: the session's /dev/shm is not in its view
        with open(path, "w") as f:
            f.write(source)
        try:
            res = w.request("probe", cfg.timeout_s, "running the task", task=str(path), **_probe_args(cfg))
        except WorkerError as e:
            res = {"status": "dropped", "reason": e.reason if e.reason in ("timeout", "oom") else "crash",
                   "detail": e.message[:2000]}
        wait = w.ready_wait
    res["metrics"] = {**res.get("metrics", {}), "probe_s": round(time.perf_counter() - t0, 3),
                      **({"worker_wait_s": round(wait, 3)} if wait is not None else {})}
    return res


# drops a previous task in the same process could have caused: decided again in a fresh one
STATEFUL_DROPS = frozenset({"crash", "timeout", "oom", "eager_failed", "compile_failed", "internal_error"})


@dataclass
class _Slot:
    gpu: str
    session: Any
    worker: Any
    served: int = 0


class ProbeSlots:
    """Each filter thread's probe worker, kept for up to `cfg.per_worker` tasks (see the module's docstring)."""

    def __init__(self, cfg: FilterConfig, gpus: list[str]):
        self.cfg, self.gpus = cfg, gpus
        self._local = threading.local()
        self._threads = itertools.count()  # thread k probes on GPU k mod n: each thread keeps its GPU
        self._slots: dict[int, _Slot] = {}
        self._lock = threading.Lock()

    def probe(self, source: str) -> dict:
        from sandbox.confinement.processes import WorkerError

        t0 = time.perf_counter()
        if not hasattr(self._local, "gpu"):
            self._local.gpu = self.gpus[next(self._threads) % len(self.gpus)]
        gpu = self._local.gpu
        slot: _Slot | None = getattr(self._local, "slot", None) or self._start(gpu)
        served = slot.served
        cfg = self.cfg
        try:
            res = slot.worker.request("probe_source", cfg.timeout_s, "running the task", source=source,
                                      **_probe_args(cfg))
        except WorkerError as e:
            res = {"status": "dropped", "reason": e.reason if e.reason in ("timeout", "oom") else "crash",
                   "detail": e.message[:2000]}
        if "status" not in res:  # the role's own failure, answered as an error
            res = {"status": "dropped", "reason": res.get("reason") or "internal_error",
                   "detail": res.get("message", "")[:2000]}
        wait = slot.worker.ready_wait if served == 0 else 0.0
        slot.served += 1
        metrics = res.get("metrics", {})
        if (res.get("reason") in STATEFUL_DROPS or not metrics.get("reusable", True)
                or slot.served >= max(1, cfg.per_worker)):
            self._retire(slot)
        if served and res["status"] == "dropped" and res.get("reason") in STATEFUL_DROPS:
            again = probe_one(source, cfg, gpu)
            again["metrics"] = {**again.get("metrics", {}), "retried_fresh": res.get("reason"),
                                "probe_s": round(time.perf_counter() - t0, 3)}
            return again
        res["metrics"] = {**metrics, "probe_s": round(time.perf_counter() - t0, 3),
                          **({"worker_wait_s": round(wait, 3)} if wait is not None else {})}
        return res

    def _start(self, gpu: str) -> _Slot:
        from sandbox.backend import on_gpu
        from sandbox.confinement.processes import Session

        with on_gpu(gpu) if gpu else contextlib.nullcontext():
            session = Session("cuda" if self.cfg.backend == "cuda" else "cpu")
            session.__enter__()
            try:
                worker = session.spawn("synth_probe")
            except BaseException:
                session.__exit__(None, None, None)
                raise
        slot = _Slot(gpu, session, worker)
        self._local.slot = slot
        with self._lock:
            self._slots[id(slot)] = slot
        return slot

    def _retire(self, slot: _Slot) -> None:
        with self._lock:
            if self._slots.pop(id(slot), None) is None:
                return
        if getattr(self._local, "slot", None) is slot:
            self._local.slot = None
        slot.session.__exit__(None, None, None)  # its worker ends in the background (confinement/reaper.py)

    def close(self) -> None:
        with self._lock:
            left = list(self._slots.values())
        for slot in left:
            self._retire(slot)


def run_filter(rows: Iterable[dict], cfg: FilterConfig, on_result: Callable[[dict], None],
               progress: bool = True, expired: Callable[[], bool] = lambda: False) -> Faults:
    """Probe every row (with its `source`); on_result gets each row, status and reason filled in. Once
    `expired()` says so, tasks not yet started are left for a resumed run, and so is a task the filter itself
    failed on (synth.slots.Faults, returned)."""
    rows = list(rows)
    gpus = _gpu_list(cfg)
    jobs = max(1, cfg.jobs)
    if jobs > (1 if cfg.ray else len(gpus)):
        cfg = shared_device_band(cfg)
    t0 = time.monotonic()
    done = kept = 0
    faults = Faults()
    if cfg.ray:  # each actor probes on its own node and GPU (Ray's CUDA_VISIBLE_DEVICES reaches the worker)
        from harness.cluster.executor import RayExecutor

        executor: Any = RayExecutor(cfg.ray, cfg.backend, per_actor=jobs)
        gpus = [""]
    else:
        executor = ThreadPoolExecutor(max_workers=jobs)
    # Ray's actors run each call in a thread of their own: a worker kept per thread would outlive the build there
    slots_kept = ProbeSlots(cfg, gpus) if cfg.per_worker > 1 and not cfg.ray else None
    # Ray's actors queue what they are given: it gets every task at once, as before; the local pool gets
    # `jobs` at a time (synth.slots), so nothing starts past the time limit
    slots = len(rows) if cfg.ray else jobs
    # the executor's threads finish first, then the kept workers end
    with contextlib.closing(slots_kept) if slots_kept else contextlib.nullcontext(), executor as pool:
        def probe(item: tuple[int, dict]) -> dict:
            i, r = item
            if slots_kept:
                return slots_kept.probe(r["source"])
            return probe_one(r["source"], cfg, gpus[i % jobs % len(gpus)])

        for (_, in_row), fut in run_slots(pool, probe, enumerate(rows), slots, lambda: expired() or faults.tripped):
            row = dict(in_row)
            try:
                res = fut.result()
            except Exception as e:  # the filter's own failure: the task stays undecided (synth.slots.Faults)
                faults.note(f"{row.get('id')}: {type(e).__name__}: {e}")
                continue
            faults.note(None)
            if not res.get("ok", True) and "status" not in res:
                res = {"status": "dropped", "reason": res.get("reason", "internal_error"),
                       "detail": res.get("message", "")[:2000]}
            row["status"] = res["status"]
            row["reason"] = res.get("reason")
            row["detail"] = res.get("detail")
            row["metrics"] = {**row.get("metrics", {}), **res.get("metrics", {})}
            on_result(row)
            done += 1
            kept += row["status"] == "kept"
            if progress:
                rate = done / max(time.monotonic() - t0, 1e-9) * 60
                ray = ""
                if cfg.ray:
                    st = pool.status()
                    ray = (f" | ray: {st['alive']}/{len(st['actors'])} actors on {st['nodes']} nodes, "
                           f"{st['in_flight']} running, {st['retried']} retried")
                print(f"filter: {done}/{len(rows)} done, {kept} kept, {rate:.1f} tasks/min{ray}", file=sys.stderr,
                      flush=True)
    return faults


def filter_dir(in_rows: list[dict], out, cfg: FilterConfig, progress: bool = True,
               expired: Callable[[], bool] = lambda: False) -> Faults:
    todo = [r for r in in_rows if not out.done(r["id"])]

    def record(row: dict) -> None:
        out.write(row, row.get("source") if row["status"] == "kept" else None)

    return run_filter(todo, cfg, record, progress, expired)


