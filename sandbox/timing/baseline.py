"""The reference's timings (eager and torch.compile): measured in fresh processes, re-timed when noisy,
and cached per task content, device, torch version, compile mode and timing protocol.

`time_reference` needs no workspace and no candidate: `profile` uses it for its baselines and
`bench/fidelity.py` uses it to compare our baselines with KernelBench's published table.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

from pydantic import BaseModel

from sandbox.config import ProfileConfig, cache_dir
from sandbox.confinement.processes import Session
from sandbox.correctness.verify import new_seed
from sandbox.results import BatchWall, Timing
from sandbox.timing import judge_clock, sealed, timing_bound, waits
from sandbox.timing.device_lock import device_lock
from tasks.loader import library_task

# 4: baselines re-timed while noisy; 7: batches timed by the judge's clock (calibrates the timing bound);
# 8: on CUDA the bound's calibration is a separate eager run under the candidate's kernel audit; 9: on CUDA fast
# calls run as a stream scored by the judge's clock (sandbox/worker/batches.py), every timing under the audit's
# profiler (eager, torch.compile and the candidate alike), so eager's own run is the calibration; 10: on the CPU each
# batch's run-queue wait is read (loaded measurements are timed again), and torch.compile is timed between two eager
# timings, checked (compile_checks), and timed again where that is noisy or slower than eager (issues 65 and 68); 11:
# the checks keep how much slower than alone the load could have made any of the three timings (`slowed`), refused by
# compile_noise as a pairing refuses eager's batches waiting that long (issue 65, item 7): a record of 10 lacks it
PROTOCOL_VERSION = 11


def timing_cfg(cfg: ProfileConfig) -> dict:
    """The settings the timer process measures with."""
    return {k: getattr(cfg, k) for k in ("warmup_ms", "min_warmup_calls", "target_ms", "min_trials", "max_trials",
                                         "audit_timed_calls", "timing_batches", "min_batch_ms", "max_batch_calls")}


def baseline_key(task_sha: str, device_name: str, torch_version: str, backend: str, cfg: ProfileConfig) -> str:
    parts = [task_sha, device_name, torch_version, backend, cfg.compile_mode, str(PROTOCOL_VERSION),
             json.dumps(timing_cfg(cfg), sort_keys=True), f"{cfg.retime_iqr_fraction}:{cfg.retime_max}"]
    # keyed by the device's kind (its name), not by which of a host's GPUs measured it: a baseline now keeps only
    # ratios and calibration, and every GPU of a host judging the same task shares one (paired timings take eager
    # on the GPU that times the candidate)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _cache_file(key: str) -> Path:
    return cache_dir() / "baselines" / f"{key}.json"


def load_cached(key: str) -> dict | None:
    try:
        return sealed.opened(json.loads(_cache_file(key).read_text()))
    except (OSError, ValueError):
        return None


def store(key: str, data: dict) -> None:
    path = _cache_file(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(sealed.seal(data)))
    os.replace(tmp, path)


def relative_spread(t: dict | Timing) -> float:
    """IQR as a share of the median (inf for a zero median: such a timing says nothing)."""
    iqr, med = (t.iqr_ms, t.median_ms) if isinstance(t, Timing) else (t["iqr_ms"], t["median_ms"])
    return iqr / med if med > 0 else float("inf")


def needs_retime(t: dict | Timing, cfg: ProfileConfig) -> bool:
    return relative_spread(t) > cfg.retime_iqr_fraction


def waited(t: dict | Timing) -> float | None:
    """The mean share of a timing's batches spent waiting for a core (sandbox/timing/waits.py; None: not read)."""
    batches = t.batches if isinstance(t, Timing) else t.get("batches", [])
    return waits.mean([b.waited if isinstance(b, BatchWall) else b.get("waited") for b in batches])


def loaded(t: dict | Timing, cfg: ProfileConfig) -> bool:
    """Measured under load: its batches waited for a core long enough to have run baseline_max_drift times slower
    than alone (the factor a paired eager may differ from its baseline by)."""
    return waits.slowed(waited(t)) > cfg.baseline_max_drift


def time_with_retime(measure, cfg: ProfileConfig) -> dict:
    """Measure; while the spread is too large or the machine was loaded, measure again (at most retime_max more
    times), and keep the best measurement: an unloaded one before a loaded one, then the smallest relative spread,
    counting the repeats in `retimed`."""
    def worse(t: dict) -> tuple[bool, float]:
        return loaded(t, cfg), relative_spread(t)

    best = measure()
    retimed = 0
    while (needs_retime(best, cfg) or loaded(best, cfg)) and retimed < cfg.retime_max:
        retimed += 1
        again = measure()
        if worse(again) < worse(best):
            best = again
    return {**best, "retimed": retimed}


def compile_checks(before: dict, compiled: dict, after: dict) -> dict:
    """What says whether a torch.compile timing is as trustworthy as eager's: eager timed before and after it (how
    far the machine moved meanwhile), its own batches' spread, and how far the load could have moved its ratio to
    eager (their waits, CPU): the rules of a paired round (paired.noise), applied by compile_noise."""
    meds = [b.get("ms") or b["reported_median_ms"] for b in compiled.get("batches", [])] or [compiled["median_ms"]]
    e0, e1 = before["median_ms"], after["median_ms"]
    # the largest slow-down the run-queue waits allow any of the three timings (None: not read, as on CUDA). A load
    # over all three moves no `load` factor, yet it moves the ratio: it slows OpenMP barriers more than the waits say
    # (the pairing's rule for eager's batches, paired.noise), and torch.compile's fused loops differ from eager's ops
    shares = [waited(t) for t in (before, compiled, after)]
    slowed = max(waits.slowed(w) for w in shares) if any(w is not None for w in shares) else None
    return {"eager_moved": max(e0, e1) / max(min(e0, e1), 1e-9), "spread": max(meds) / max(min(meds), 1e-9),
            "load": waits.load_factor(waited(compiled), waits.mean([waited(before), waited(after)])),
            "slowed": slowed, "ratio": compiled["median_ms"] / max((e0 + e1) / 2, 1e-9)}


def compile_noise(checks: dict | None, cfg: ProfileConfig) -> str | None:
    """Why a baseline's torch.compile figure cannot carry a milestone, or None (checks: compile_checks')."""
    if not checks:
        return None
    lim = cfg.noise_max_spread
    if checks["eager_moved"] > lim:
        return f"eager moved {checks['eager_moved']:.2f}x while torch.compile was timed (over the {lim:g}x allowed)"
    if checks["spread"] > lim:
        return f"torch.compile's batches were {checks['spread']:.2f}x apart (over the {lim:g}x allowed)"
    if checks.get("load") is not None and checks["load"] > lim:
        return (f"the machine's load could have moved torch.compile's ratio to eager {checks['load']:.2f}x (over the "
                f"{lim:g}x allowed)")
    if checks.get("slowed") is not None and checks["slowed"] > lim:
        return (f"torch.compile's or the eager timings' threads around it waited for a core long enough to have run "
                f"{checks['slowed']:.2f}x slower than alone (over the {lim:g}x allowed): other work held the cores")
    return None


def compile_timed(measure, first_eager: dict, cfg: ProfileConfig) -> tuple[dict, dict]:
    """torch.compile timed between two eager timings (`measure(variant)` gives a function that times it once), again
    while that is noisy (at most retime_max more times) and once more where it was slower than eager (`retimed`
    counts the attempts before the one kept): the timing
    with the smallest ratio to eager among the clean ones (else among all), and its checks ("attempts": how many
    were timed). Load only slows a timing down, so of two clean timings the faster torch.compile is the fair bar: an
    honest kernel at 1.0x eager does not beat a torch.compile that one loaded moment made look 2.7x slower (issue 68)."""
    before, tries = first_eager, []
    for _ in range(1 + cfg.retime_max):
        # once each: a noisy attempt is itself what is timed again (under load, retiming each timing inside it too
        # took a baseline past ten timings)
        compiled = {**measure("compiled")(), "retimed": len(tries)}
        after = measure("eager")()
        tries.append((compiled, compile_checks(before, compiled, after)))
        before = after
        clean = [t for t in tries if compile_noise(t[1], cfg) is None]
        if clean and (min(t[1]["ratio"] for t in clean) <= 1.0 or len(clean) >= 2):
            break
    pool = [t for t in tries if compile_noise(t[1], cfg) is None] or tries
    compiled, checks = min(pool, key=lambda t: t[1]["ratio"])
    return compiled, {**checks, "attempts": len(tries)}


def is_launch_bound(eager: Timing | None, cfg: ProfileConfig) -> bool | None:
    """Eager time below the floor: the baselines then measure launch and guard overhead, not compute."""
    return None if eager is None else eager.median_ms < cfg.launch_bound_ms


def speedup_range(base: Timing, cand: Timing) -> tuple[float, float] | None:
    """The speedup between the timings' quartiles (median -+ IQR/2): slowest baseline over fastest candidate
    bounds it above, and the reverse below."""
    lo_c, hi_c = cand.median_ms - cand.iqr_ms / 2, cand.median_ms + cand.iqr_ms / 2
    lo_b, hi_b = base.median_ms - base.iqr_ms / 2, base.median_ms + base.iqr_ms / 2
    if lo_c <= 0 or hi_c <= 0:
        return None
    return (max(lo_b, 0.0) / hi_c, hi_b / lo_c)


class BaselineError(Exception):
    """The reference itself failed to build or run."""


COMPILED_KERNELS = 8  # torch.compile's top kernels kept with a baseline


class _VariantFailed(Exception):
    pass


class BaselineTimes(BaseModel):
    eager: Timing
    compiled: Timing | None = None
    compile_error: str | None = None
    calibration: Timing | None = None  # eager again under the kernel audit (CUDA): the timing bound's o only
    compile_mode: str
    device: str
    torch_version: str
    cached: bool = False
    # which Inductor cache the compiled baseline used (the judge's persistent one or a cold scratch
    # directory) and its hits and misses; None in records from before it was kept
    compile_cache: dict | None = None
    created: float | None = None  # when it was measured (time.time()); None in records from before it was kept
    refreshed: str | None = None  # why this call measured it again despite a cached record: "age", "drift", "compile"
    # torch.compile's checks (compile_checks, the chosen timing's, and "attempts"): compile_noise says whether the
    # compiled figure may carry a milestone; None in records from before protocol 10
    compile_checks: dict | None = None
    # torch.compile's top kernels (name, total_ms a call, calls, percent), for `analyze`; None in older records
    compiled_kernels: list[dict] | None = None


def measure_reference(task_path: str, device: str, cfg: ProfileConfig) -> dict:
    """Time the reference in a fresh process: eager, then torch.compile in cfg.compile_mode.
    Raises BaselineError when the reference fails; a torch.compile failure is recorded, not raised."""
    init_seed, seed = new_seed(), new_seed()
    tcfg = {**timing_cfg(cfg), "measure_waits": device == "cpu"}
    with Session(device) as s, contextlib.ExitStack() as stack:
        w = s.spawn("baseline", compile_cache=library_task(Path(task_path).read_bytes()))
        # the timings' batches read by the judge's clock process (judge_clock), started while the reference builds
        stack.enter_context(judge_clock.attached([w], cfg.judge_clock_process))
        r = w.request("setup", cfg.setup_timeout_s, "building the reference", task=task_path, device=device,
                      init_seed=init_seed, which="reference", compile_mode=cfg.compile_mode)
        if not r["ok"]:
            raise BaselineError(r["message"])
        info = {"device_name": r.get("device_name"), "torch_version": r.get("torch_version")}

        def measure(variant: str, timeout: float, what: str, audited: bool = False):
            def once() -> dict:
                try:
                    with device_lock(device, exclusive=True):
                        t = timing_bound.measure(w, variant, seed, {**tcfg, "audited_calibration": audited}, timeout,
                                                 what)
                except timing_bound.TimingFailed as e:
                    raise _VariantFailed(e.reply.get("message", "")) from None
                t.pop("end")
                return t
            return once

        # the candidate's timed calls run under the kernel audit's profiler (CUDA), whose per-launch cost the
        # judge's clock sees: every baseline timing runs under it too, so that the ratios compare like with like,
        # and eager's run is also the timing bound's calibration
        audited = device == "cuda" and cfg.audit_timed_calls
        try:
            eager = time_with_retime(measure("eager", cfg.timing_timeout_s, "timing the reference (eager)", audited),
                                     cfg)
        except _VariantFailed as e:
            raise BaselineError(e.args[0]) from None
        out = {"eager": eager, "compiled": None, "compile_error": None, "created": time.time(), **info}
        if audited:
            out["calibration"] = eager
        try:
            # torch.compile compiles on the first call, on every core: like a build, under the shared lock,
            # so the exclusive timing below only times (other judgments wait for it, not for a compile)
            with device_lock(device, exclusive=False):
                r = w.request("warm", cfg.baseline_timeout_s, "compiling the reference under torch.compile",
                              variant="compiled", seed=seed)
            if not r["ok"]:
                raise _VariantFailed(r.get("message", ""))
            def variant(name: str):
                return measure(name, cfg.baseline_timeout_s, f"timing the reference ({name})", audited)

            out["compiled"], out["compile_checks"] = compile_timed(variant, eager, cfg)
            # torch.compile's top kernels, kept for `analyze` (what a candidate competes with): advice, under the
            # shared lock like the compile
            with device_lock(device, exclusive=False):
                k = w.request("kernels", cfg.baseline_timeout_s, "listing torch.compile's kernels", seed=seed,
                              top=COMPILED_KERNELS, variant="compiled")
            out["compiled_kernels"] = k["kernels"] if k.get("ok") else None
        except _VariantFailed as e:
            out["compile_error"] = e.args[0][:2000]
        r = w.request("compile_cache", cfg.setup_timeout_s, "reading the compile cache's counters")
        out["compile_cache"] = {k: v for k, v in r.items() if k not in ("ok", "elapsed_s", "started_at")} if r.get("ok") else None
    return out


def time_reference(task_path: str, task_sha: str, backend: str, device_name: str, torch_version: str,
                   cfg: ProfileConfig, refresh: str | None = None) -> BaselineTimes:
    """The cached baselines of a task, measuring them when the cache has none (or cfg.use_cache is off), when
    the cached record is older than cfg.baseline_max_age_s, or when `refresh` names why it must be."""
    key = baseline_key(task_sha, device_name, torch_version, backend, cfg)
    cached = load_cached(key) if cfg.use_cache and refresh is None else None
    if cached is not None and time.time() - cached.get("created", 0.0) > cfg.baseline_max_age_s:
        cached, refresh = None, "age"
    hit = cached is not None
    if cached is None:
        cached = measure_reference(task_path, "cuda" if backend == "cuda" else "cpu", cfg)
        store(key, cached)
    return BaselineTimes(eager=Timing(**cached["eager"]),
                         compiled=Timing(**cached["compiled"]) if cached.get("compiled") else None,
                         compile_error=cached.get("compile_error"),
                         calibration=Timing(**cached["calibration"]) if cached.get("calibration") else None,
                         compile_mode=cfg.compile_mode,
                         device=device_name, torch_version=torch_version, cached=hit,
                         compile_cache=cached.get("compile_cache"), created=cached.get("created"),
                         refreshed=refresh, compile_checks=cached.get("compile_checks"),
                         compiled_kernels=cached.get("compiled_kernels"))


def compile_ratio(b: BaselineTimes) -> tuple[float | None, tuple[float, float] | None]:
    """The baseline's torch.compile time over its eager time, and that ratio's range between the timings'
    quartiles: speedup_vs_compile is speedup_vs_eager times the ratio."""
    if b.compiled is None or b.eager.median_ms <= 0:
        return None, None
    plain, rng = b.compiled.median_ms / b.eager.median_ms, speedup_range(b.compiled, b.eager)
    # torch.compile's own eager pair (baseline.compile_timed: the eager timings either side of it), where kept
    ratio = (b.compile_checks or {}).get("ratio") or plain
    return ratio, (rng[0] * ratio / plain, rng[1] * ratio / plain) if rng is not None and plain > 0 else None


def compile_estimate(b: BaselineTimes, eager_now: Timing) -> tuple[Timing | None, float | None,
                                                                   tuple[float, float] | None]:
    """torch.compile now: the baseline's compiled timing scaled by eager now over eager then, the ratio, and
    the ratio's range between the baseline timings' quartiles. Timing torch.compile in every profile would
    mean compiling in every profile (2.4 s on the 2-core CPU even from the warm Inductor cache)."""
    ratio, ratio_range = compile_ratio(b)
    if ratio is None or b.compiled is None:
        return None, None, None
    k = eager_now.median_ms * ratio / b.compiled.median_ms if b.compiled.median_ms > 0 else 0.0
    ms = ("median_ms", "mean_ms", "std_ms", "min_ms", "max_ms", "iqr_ms")
    now = Timing(**{**b.compiled.model_dump(), **{f: getattr(b.compiled, f) * k for f in ms},
                    "round_trip_ms": None, "batches": []})
    return now, ratio, ratio_range
