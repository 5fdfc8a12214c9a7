"""The self-check gate: a task enters the set only if the judge itself can judge it.

Two checks, both through the real judge rather than the synthesis probe: the reference's eager time measured
by the judge's own timing protocol (the baseline worker, under the device lock, re-timed while noisy) and
held to the band, then the reference verified against itself (`sandbox.correctness.selfcheck.self_verify`:
builds, runs, is deterministic across trials and seeds). The band goes first because it drops the most. The filter measured the same things its own way;
this gate is what makes "every task in the set can be judged" true of the judge that will use them.

Tasks run `jobs` at a time, in chunks: a chunk's tasks are all timed (each timing holds the device lock
exclusively, sandbox/timing/device_lock.py, so the eager times stay uncontended), then those in the band are
verified side by side (verification holds it shared). Interleaving the two kept every timing waiting for the
verifications in flight to drain. A task the gate itself fails on (an exception, not a verdict) stays undecided
for a resumed build (synth.slots.Faults).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from synth.slots import Faults, run_slots

# a first, short measurement decides a task clearly outside the band, or clearly inside it: a reading this far
# past an edge, or this far within both, is not noise of the device held alone (contention only slows; the first
# calls are not faster than later ones). Only a reading near an edge takes the judge's full protocol. On the H100
# that full protocol was most of the gate's exclusive device time, and 53% of the tasks it timed read this far
# inside (3daac8d:bench/results/synth_build_state.tgz, slices 2-3)
QUICK_MARGIN = 1.5
# the gate's tasks go in chunks of this many per slot: timed together, then verified together (_run)
CHUNK_SLOTS = 8


def quick_decides(ms: float, band: tuple[float, float]) -> bool:
    """Whether a short measurement's reading decides the band by itself: far outside it, or far inside both edges."""
    lo, hi = band
    return ms < lo / QUICK_MARGIN or ms > hi * QUICK_MARGIN or lo * QUICK_MARGIN <= ms <= hi / QUICK_MARGIN


def judge_eager_ms(task_path: str, device: str, pcfg=None, band: tuple[float, float] | None = None,
                   stats: dict | None = None) -> tuple[float, str]:
    """The reference's eager median as the judge's baseline timer measures it (no torch.compile half), and how:
    "full" (the judge's protocol, re-timed while noisy), or "quick" where `band` is given and a short first
    measurement (a tenth of the timed budget, in three batches) is more than QUICK_MARGIN outside it, or that much
    inside both edges. `stats`, where given, gets where the seconds went: the worker and the reference's set-up,
    the waits for the device lock and the measurements under it."""
    from sandbox.config import ProfileConfig
    from sandbox.confinement.processes import Session
    from sandbox.correctness.verify import new_seed
    from sandbox.timing import timing_bound
    from sandbox.timing.baseline import BaselineError, time_with_retime, timing_cfg
    from sandbox.timing.device_lock import device_lock

    pcfg = pcfg or ProfileConfig()
    stats = {} if stats is None else stats
    stats.update(setup_s=0.0, lock_wait_s=0.0, timing_s=0.0, measurements=0)
    clock = time.perf_counter
    t0 = clock()
    init_seed, seed = new_seed(), new_seed()
    tcfg = {**timing_cfg(pcfg), "audited_calibration": False}
    with Session(device) as s:
        w = s.spawn("baseline")
        r = w.request("setup", pcfg.setup_timeout_s, "building the reference", task=task_path, device=device,
                      init_seed=init_seed, which="reference", compile_mode=pcfg.compile_mode)
        if not r["ok"]:
            raise BaselineError(r["message"])
        stats["setup_s"] = round(clock() - t0, 3)

        def once(cfg: dict = tcfg) -> dict:
            t1 = clock()
            try:
                with device_lock(device, exclusive=True):
                    t2 = clock()
                    try:
                        t = timing_bound.measure(w, "eager", seed, cfg, pcfg.timing_timeout_s,
                                                 "timing the reference (eager)")
                    finally:
                        stats["lock_wait_s"] = round(stats["lock_wait_s"] + t2 - t1, 3)
                        stats["timing_s"] = round(stats["timing_s"] + clock() - t2, 3)
                        stats["measurements"] += 1
            except timing_bound.TimingFailed as e:
                raise BaselineError(e.reply.get("message", "")) from None
            t.pop("end")
            return t

        if band is not None:
            quick = {**tcfg, "target_ms": tcfg["target_ms"] / 10, "min_trials": 3, "warmup_ms": tcfg["warmup_ms"] / 5,
                     "timing_batches": 3}
            ms = float(once(quick)["median_ms"])
            if quick_decides(ms, band):
                return ms, "quick"
        return float(time_with_retime(once, pcfg)["median_ms"]), "full"


def time_one(row: dict, folder: Path, backend: str, band: tuple[float, float]) -> dict:
    """The gate's first half: the task timed by the judge and held to the band. A verdict ({status: dropped,
    reason, detail, metrics}), or {status: "timed", metrics} for a task in the band, which verify_one finishes.
    The band first: on a GPU about half of what the filter passes is outside it once timed alone (the filter's
    eight probes per GPU read eager 7x slow at the median), and such a task then costs one short timing, not a
    verification too."""
    from sandbox.timing.baseline import BaselineError

    path = folder / row["file"]
    metrics: dict = {}
    t1 = time.perf_counter()
    stats: dict = {}
    try:
        ms, how = judge_eager_ms(str(path.resolve()), "cuda" if backend == "cuda" else "cpu", band=band, stats=stats)
    except BaselineError as e:
        return {"status": "dropped", "reason": "selfcheck_timing_failed", "detail": str(e)[:2000], "metrics": metrics}
    metrics.update(judge_eager_ms=ms, judge_timing=how, selfcheck_time_s=round(time.perf_counter() - t1, 3),
                   **{f"selfcheck_{k}": v for k, v in stats.items()})
    lo, hi = band
    if not lo <= ms <= hi:
        return {"status": "dropped", "reason": "selfcheck_time_band",
                "detail": f"the judge timed eager at {ms:.4g} ms ({how} measurement), outside {lo:g}-{hi:g} ms",
                "metrics": metrics}
    return {"status": "timed", "reason": None, "detail": None, "metrics": metrics}


def verify_one(row: dict, folder: Path, backend: str, metrics: dict, trials: int = 1) -> dict:
    """The gate's second half, for a task in the band: the reference verified against itself."""
    from sandbox.correctness.selfcheck import self_verify
    from tasks.loader import load_task

    metrics = dict(metrics)
    t0 = time.perf_counter()
    v = self_verify(load_task(folder / row["file"]), backend, trials=trials)
    metrics["selfcheck_verify_s"] = round(time.perf_counter() - t0, 3)
    if not v.ok:
        return {"status": "dropped", "reason": f"selfcheck_{v.reason}", "detail": (v.message or "")[:2000],
                "metrics": metrics}
    return {"status": "kept", "reason": None, "detail": None, "metrics": metrics}


def check_one(row: dict, folder: Path, backend: str, band: tuple[float, float], trials: int = 1) -> dict:
    """The gate's verdict on one task: {status, reason, detail, metrics}."""
    res = time_one(row, folder, backend, band)
    return verify_one(row, folder, backend, res["metrics"], trials) if res["status"] == "timed" else res


# failures that other slots' memory or load can cause: retried alone before they count
RETRY_ALONE = ("selfcheck_oom", "selfcheck_timeout", "selfcheck_crash", "selfcheck_cuda_error",
               "selfcheck_timing_failed")


def run_gate(rows: list[dict], folder: Path, backend: str, band: tuple[float, float], jobs: int,
             on_result: Callable[[dict], None], expired: Callable[[], bool] = lambda: False,
             progress: bool = True, gpus: list[str] | None = None) -> Faults:
    """Check every row (tasks of `folder`); on_result gets each row with the verdict merged in. Once
    `expired()` says so, tasks not yet started are left for a resumed run, and so is a task the gate itself
    failed on (synth.slots.Faults, returned). On CUDA the slots spread over `gpus` (None: every visible GPU),
    each task judged on one of them."""
    from sandbox.backend import GpuRing

    ring = GpuRing(backend, gpus)
    if backend == "cuda":
        from sandbox.api import expect_judgments

        expect_judgments(jobs, backend, ring.gpus or None)
    retry: list[dict] = []
    faults = Faults()

    def hold(row: dict) -> None:
        if jobs > 1 and row["reason"] in RETRY_ALONE:
            retry.append(row)
        else:
            on_result(row)

    _run(rows, folder, backend, band, jobs, hold, expired, progress, ring, faults)
    _run(retry, folder, backend, band, 1, on_result, expired, progress, ring, faults)
    return faults


def _run(rows: list[dict], folder: Path, backend: str, band: tuple[float, float], jobs: int,
         on_result: Callable[[dict], None], expired: Callable[[], bool], progress: bool, ring,
         faults: Faults) -> None:
    """In chunks of CHUNK_SLOTS x jobs tasks: every task of a chunk timed, then those in the band verified. A
    timing holds the device exclusively and a verification shares it, so interleaved (one task start to end
    per slot) every timing waited for the verifications in flight to drain: on an H100, 4.0 s of the 4.5 s a
    short timing took with eight slots was that wait (3daac8d:bench/results/synth_build_slice6_h100.log)."""
    t0 = time.monotonic()
    stop = lambda: expired() or faults.tripped  # noqa: E731
    count = {"done": 0, "kept": 0}

    def decided(row: dict, res: dict) -> None:
        row.update(status=res["status"], reason=res["reason"], detail=res["detail"],
                   metrics={**row.get("metrics", {}), **res["metrics"]})
        on_result(row)
        count["done"] += 1
        count["kept"] += row["status"] == "kept"
        if progress:
            rate = count["done"] / max(time.monotonic() - t0, 1e-9) * 60
            print(f"selfcheck: {count['done']}/{len(rows)} done, {count['kept']} kept, {rate:.1f} tasks/min",
                  file=sys.stderr, flush=True)

    def phase(items: list, fn: Callable[[Any], dict]):
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for item, fut in run_slots(pool, fn, items, jobs, stop):
                try:
                    res = fut.result()
                except Exception as e:  # the gate's own failure: the task stays undecided (synth.slots.Faults)
                    row = item[0] if isinstance(item, tuple) else item
                    faults.note(f"{row.get('id')}: {type(e).__name__}: {e}")
                    continue
                faults.note(None)
                yield item, res

    def timed(row: dict) -> dict:
        with ring.next():
            return time_one(row, folder, backend, band)

    def verified(item: tuple[dict, dict]) -> dict:
        with ring.next():
            return verify_one(item[0], folder, backend, item[1])

    size = max(1, jobs) * CHUNK_SLOTS
    for i in range(0, len(rows), size):
        if i and stop():
            break
        in_band = []
        for row, res in phase(rows[i:i + size], timed):
            if res["status"] == "timed":
                in_band.append((dict(row), res["metrics"]))
            else:
                decided(dict(row), res)
        # timed but past the limit before verified: timed again by the resumed run (at most a chunk's timings)
        for (row, _), res in phase(in_band, verified):
            decided(row, res)
