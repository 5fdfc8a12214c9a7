"""Paired timings: eager timed beside the candidate, in alternating batches of the same session.

A speedup is the ratio of two times, and two times taken apart are also two states of the machine: an
eager baseline cached while other processes loaded the cores read 8.0 ms for a ReLU that takes a
fraction of that on a quiet machine, and made an honest kernel at 0.26x eager score 6-10x. So the eager
time a reward rests on is measured here, in the profile's own session, batch against batch with the
candidate's: eager, candidate, eager, ..., eager, each side's processes stopped while the other is timed.
The cached baseline keeps only what is expensive to make: torch.compile's time relative to eager, the
launch-bound classification and, on CUDA, the timing bound's calibration under the kernel audit.
"""

from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Protocol

from sandbox.confinement import proctree
from sandbox.confinement.processes import WorkerError
from sandbox.correctness.verify import new_seed
from sandbox.results import PairedRound, TimingBound
from sandbox.timing import timing_bound, waits
from sandbox.timing.baseline import BaselineTimes, is_launch_bound

if TYPE_CHECKING:
    from sandbox.config import ProfileConfig


# the most a pairing's counted rounds' speedups may disagree by: an order of magnitude. A candidate's own drift over
# a pairing, each step inside candidate_max_spread, reached 6x in a stream test (tests/test_stream_timing.py) and is
# scored; an honest abs kernel scored 0.0003x in one profile and 0.31x in another (issue 65) is not a speedup
ROUNDS_MAX_SPREAD = 10.0


class StopRule(Protocol):
    """What pair() asks of a stop rule (sandbox.timing.early_stop.StopRule, which builds on this module)."""

    min_rounds: int

    def check(self, eager: timing_bound.Run, cand: timing_bound.Run) -> str | None: ...


@contextmanager
def paused(pid: int, spent: dict | None = None):
    """SIGSTOP a worker's whole process tree while another is timed: nothing it left running (a thread, an
    OpenMP pool spinning down) loads the machine during the other side's batches. For the candidate that is
    a defence too: a thread that kept the cores busy while eager ran would make the candidate look faster.
    `spent["pauses"]` gathers the seconds the stopping and the resuming took (a walk of /proc each time)."""
    with proctree.stopped([pid], spent):
        yield


@contextmanager
def _eager_side():
    """Eager's failures are the reference's, never the candidate's: reported as reference_error."""
    try:
        yield
    except timing_bound.TimingFailed as e:
        raise timing_bound.TimingFailed({"ok": False, "reason": "reference_error",
                                         "message": "eager failed while timed beside ModelNew: "
                                         + e.reply.get("message", "")}) from None
    except WorkerError as e:
        raise WorkerError("reference_error", f"the eager timer failed ({e.reason}): {e.message}") from None


class Ahead:
    """A pairing's two runs set up before the device is held exclusively (ahead())."""

    def __init__(self, e: timing_bound.Run, c: timing_bound.Run, steps: dict):
        self.e, self.c, self.steps = e, c, steps


def _runs(eager_w, cand_w, seed: int, tcfg: dict, timeout: float, spot_checks: int,
          spot_batches: int) -> tuple[timing_bound.Run, timing_bound.Run]:
    # eager is timed the way the candidate is: on CUDA under the kernel audit's profiler (its per-launch cost is
    # on both sides of the ratio, and o is calibrated on these very batches: first_bound), and with the same
    # spot-check copies (their time too), which eager's process then drops
    e = timing_bound.Run(eager_w, "eager", new_seed(), {**tcfg, "audited_calibration": True}, timeout,
                         "timing eager beside ModelNew", spot_checks=spot_checks, spot_batches=spot_batches)
    c = timing_bound.Run(cand_w, "candidate", seed, tcfg, timeout, "timing ModelNew", spot_checks=spot_checks,
                         spot_batches=spot_batches)
    return e, c


def _sides(eager_w, cand_w, steps: dict):
    """Two wrappers that run a step of one side with the other side's processes stopped, the time into steps[kind]."""
    epid, cpid = eager_w.proc.pid, cand_w.proc.pid

    def side(kind, pid, step, wrap):
        t = time.perf_counter()
        try:
            with paused(pid, steps), wrap():
                return step()
        finally:
            steps[kind] = steps.get(kind, 0.0) + time.perf_counter() - t

    def eager(step, kind="batches"):
        return side(kind, cpid, step, _eager_side)

    def cand(step, kind="batches"):
        return side(kind, epid, step, nullcontext)

    return eager, cand


def ahead(eager_w, cand_w, seed: int, tcfg: dict, timeout: float, spot_checks: int = 0,
          spot_batches: int | None = None) -> Ahead:
    """What of a pairing's start times nothing: both sides' time_begin (warm-up, first estimate, the kernel audit's
    profiler) and their first batch's inputs, done while the caller still holds the device shared, so that the
    exclusive hold starts at the round-trip probes. On an H200 under eight judgments these were about a third of a
    small kernel's exclusive section (docs/history.md, seventeenth round), and every other judgment's timing
    queued behind them. Each side runs with the other stopped, as in pair(). `spot_batches`: the stop rule's
    min_rounds, or None for timing_batches (pair()'s choice)."""
    k = tcfg["timing_batches"]
    e, c = _runs(eager_w, cand_w, seed, tcfg, timeout, spot_checks, spot_batches or k)
    steps = {"ahead": 0.0, "pauses": 0.0}
    eager, cand = _sides(eager_w, cand_w, steps)
    eager(lambda: (e.setup(), e.prefetch()), "ahead")
    cand(lambda: (c.setup(), c.prefetch()), "ahead")
    return Ahead(e, c, steps)


def pair(eager_w, cand_w, seed: int, tcfg: dict, timeout: float, spot_checks: int = 0, top: int = 0,
         stop: StopRule | None = None, defer_audit: bool = False, ready: Ahead | None = None) -> dict:
    """One pairing: up to K candidate batches, each between two eager batches (K = timing_batches); with a stop
    rule, fewer once the rounds so far decide (sandbox/timing/early_stop.py). Returns {"eager": ...,
    "candidate": ..., "stopped": why the rounds ended}, the first two timing_bound.Run.end's dicts.
    `defer_audit`: both sides' kernel-audit profilers keep running past their ends, for finish(). `ready`: the
    runs set up by ahead() (with `seed` its candidate's): only their round trips are probed here."""
    k = tcfg["timing_batches"]
    spot_batches = stop.min_rounds if stop is not None else k
    # where the pairing's time goes (the profile's timing_* phases): the two sides' set-up of the timing (round
    # trips, warm-up, sizing), their batches (each request whole), their ends (statistics, clock checks, the
    # kernel audit), and the stopping and resuming of the other side around each; "ahead" where ahead() ran
    steps = {"begin": 0.0, "batches": 0.0, "end": 0.0, "pauses": 0.0}
    if ready is not None:
        e, c = ready.e, ready.c
        steps["ahead"], steps["pauses_ahead"] = ready.steps["ahead"], ready.steps["pauses"]
    else:
        e, c = _runs(eager_w, cand_w, seed, tcfg, timeout, spot_checks, spot_batches)
    eager, cand = _sides(eager_w, cand_w, steps)
    eager(e.probe if ready is not None else e.begin, "begin")
    cand(c.probe if ready is not None else c.begin, "begin")
    while True:
        eager(e.batch)
        stopped = "max_rounds"
        for i in range(k):
            cand(c.batch)
            eager(e.batch)
            # decided in the judge's process between batches, from the rounds so far only (both sides stopped)
            why = stop.check(e, c) if stop is not None and i + 1 < k else None
            if why is not None:
                stopped = why
                break
        if not (e.short() or c.short()):
            break
        # one side's batches were too short to bound: both time again, so that the rounds stay paired
        e.next_round()
        c.next_round()
    out = {"eager": eager(lambda: e.end(0, defer_audit), "end"), "candidate": cand(lambda: c.end(top, defer_audit), "end"),
           "stopped": stopped}
    steps["batches_clock"] = sum(b["wall_ms"] for b in e.batches + c.batches) / 1e3  # inside the batches' requests
    steps["begin_profiler"] = e.profiler_start_s + c.profiler_start_s  # inside the begins: the audit's profilers
    out["steps"] = steps
    return out


def ask_audit(w, top: int | None = None) -> None:
    """Ask a worker for the kernel audit its time_end deferred (pair(defer_audit=True)); audit_reply reads it."""
    w.send("time_audit", **({} if top is None else {"top": top}))


def audit_reply(w, timeout: float, eager: bool) -> dict:
    """The reply to ask_audit: checks, and the candidate's top-kernel rows under "kernels". Raises TimingFailed
    with the candidate's failure (torch_op_used, audit_tampered, ...); eager's is reference_error."""
    if eager:
        with _eager_side():
            return audit_reply(w, timeout, False)
    r = w.recv(timeout, "ending the timing's kernel audit")
    if not r["ok"]:
        raise timing_bound.TimingFailed(r)
    return r


def finish(eager_w, cand_w, timeout: float, top: int = 0) -> tuple[dict, dict]:
    """Both sides' deferred audits: eager's profiler stopped, the candidate's and its verdict. Host work in each
    process and nothing timed; both are asked first, so the two processes do it at the same time."""
    ask_audit(eager_w)
    ask_audit(cand_w, top)
    return audit_reply(eager_w, timeout, True), audit_reply(cand_w, timeout, False)


def _ms(batch: dict) -> float:
    """A batch's per-call time in a round: the judge's clock for a stream of calls, else the reported median."""
    return batch.get("ms", batch["reported_median_ms"])


def rounds(eager_batches: list[dict], cand_batches: list[dict], max_spread: float | None = None) -> list[PairedRound]:
    """Each candidate batch against the mean of the eager batches either side of it: a drift that is
    steady over the pairing (clocks, heat, a load coming or going) cancels to first order. `max_spread`: a round
    whose two eager batches disagree by more is not counted (the machine moved inside it: kept_rounds)."""
    out = []
    for i, c in enumerate(cand_batches):
        before, after = _ms(eager_batches[i]), _ms(eager_batches[i + 1])
        cm = _ms(c)
        moved = max(before, after) / max(min(before, after), 1e-9)
        out.append(PairedRound(eager_before_ms=before, candidate_ms=cm, eager_after_ms=after,
                               speedup=(before + after) / 2 / cm if cm > 0 else None,
                               counted=max_spread is None or moved <= max_spread))
    return out


def kept_rounds(rs: list[PairedRound]) -> list[PairedRound]:
    """The rounds the speedups count. On CUDA a small kernel's host path moved between two levels about 1.5x apart
    on a loaded H200 (eager 0.017 and 0.027 ms a call, from one batch to the next, the candidate's alike): a round
    with the move inside it says nothing, while the rounds either side of it still pair like with like. A round's
    eager batches are eager's own, timed with the candidate stopped, so leaving a round out can only cost the
    candidate a round, never lend it one."""
    return [r for r in rs if r.counted]


def eager_spread(eager_batches: list[dict], local: bool = False) -> float:
    """The slowest eager batch's median over the fastest's. Eager is the same work every batch, in a process
    that never ran candidate code, with the candidate stopped: whatever moves it is the machine. `local`: the
    largest such ratio between two consecutive eager batches, the two either side of a round (spread_is_local)."""
    meds = [_ms(b) for b in eager_batches]
    if local and len(meds) > 1:
        return max(max(x, y) / max(min(x, y), 1e-9) for x, y in zip(meds, meds[1:], strict=False))
    return max(meds) / max(min(meds), 1e-9)


def spread_is_local(backend: str) -> bool:
    """Whether the noise rule asks only that each round's two eager batches agree. On CUDA: the two processes are
    timed on one CPU core in turn (sandbox/timing/cores.py) with the device to themselves (device_lock), so a load
    on the host slows both sides' host path alike, and a drift over the pairing (clocks settling, a load coming
    or going between rounds) cancels in every round's mean of its two eager batches; only a change inside a round
    moves a speedup. A launch-bound eager on an idle H100 moved 1.57x over its six batches that way, and failed
    the example's honest kernel twice in a row. On the CPU a load slows eager's threads more than a candidate's
    loop, so a load over part of the pairing favours the candidate in those rounds: every batch counts."""
    return backend == "cuda"


def drift_counts(b: BaselineTimes, cfg: ProfileConfig, backend: str) -> bool:
    """Whether a paired eager slower than its baseline is load (noise() says so). Not for a launch-bound task on
    CUDA: its eager is a few tens of microseconds of launch and host path, which moves by half from one process
    to the next on an idle H200 (a [4096, 4096] abs: 0.044 ms in the baseline's process, 0.066 ms in every round
    of a profile's), as retimes_baseline says for the other direction. The rounds' own spread still counts, and
    on the CPU, where load slows eager's threads more than a candidate's loop, the drift always does."""
    return not (backend == "cuda" and is_launch_bound(b.eager, cfg))


def noise(run: dict, b: BaselineTimes, max_spread: float, max_drift: float, drift: bool = True,
          local: bool = False, cand_spread: float | None = None, min_kept: int | None = None) -> str | None:
    """Why a pairing cannot be scored, or None. Load only ever slows a call down, and it slows code with
    several threads (eager's OpenMP ops) more than a single-threaded loop, so a loaded machine can favour
    either side: the judge does not score through it. It shows as eager batches that disagree, or, when the
    load was there for every round, as eager slower than the baseline measured it on the same machine.

    `cand_spread`: the most two consecutive candidate batches may disagree by. A disturbance can also fall on the
    candidate's batches alone: on an H200 under sixteen judgments an honest abs kernel took 0.069 ms a call in
    its first round and 1.91 and 1.95 ms in the next two, between eager batches that agreed, and was scored
    0.02x eager where every other profile of it read 0.65x. The allowance is wider than eager's (the
    candidate's inputs differ between batches, and a data-dependent kernel may follow them); a candidate that
    moves itself by more only loses its score, to a profile again.

    `min_kept` (with `local`): rounds whose eager batches disagree are left out (kept_rounds), and the pairing is
    noisy only when fewer than `min_kept` rounds remain.

    More, from issues 65 and 69, on the run-queue waits of the two sides (sandbox/timing/waits.py, CPU backend):
    neither side's batches may have waited for a core long enough, on average, to have run more than `max_spread`
    slower than alone (a load that slows eager's OpenMP barriers far more than its waits alone say made an honest
    kernel at about 1x eager read 2.29x), nor may the two sides' waits differ enough to move a round's speedup by
    more than that (waits.pairing_factor: a candidate 120x slower than alone, its batches agreeing); and
    with `cand_spread`, the counted rounds' speedups may not disagree by more than ROUNDS_MAX_SPREAD (a pairing with a
    round at 0.0003x beside rounds at 0.3x is not scored)."""
    eb = run["eager"]["batches"]
    meds = [_ms(x) for x in eb]
    spread = eager_spread(eb, local)
    if local and min_kept is not None:
        rs = rounds(eb, run.get("candidate", {}).get("batches") or [], max_spread)
        kept = len(kept_rounds(rs))
        if kept < min(min_kept, len(rs)) or (not rs and spread > max_spread):
            return (f"eager, the same work in every round, took {min(meds):.4g} to {max(meds):.4g} ms a call, and its "
                    f"two batches of {len(rs) - kept} of {len(rs)} rounds were more than {max_spread:g}x apart: "
                    f"{kept} undisturbed rounds, fewer than the {min_kept} a speedup rests on")
    elif spread > max_spread:
        where = "in two batches one round apart, " if local else ""
        return (f"eager, the same work in every round, took {min(meds):.4g} to {max(meds):.4g} ms a call "
                f"({where}{spread:.2f}x apart, over the {max_spread:g}x allowed)")
    cb = run.get("candidate", {}).get("batches") or []
    if cand_spread is not None and len(cb) > 1:
        lo, hi = max((sorted((_ms(x), _ms(y))) for x, y in zip(cb, cb[1:], strict=False)),
                     key=lambda pair: pair[1] / max(pair[0], 1e-9))
        if hi / max(lo, 1e-9) > cand_spread:
            return (f"ModelNew took {lo:.4g} ms a call in one round and {hi:.4g} ms in the next "
                    f"({hi / max(lo, 1e-9):.1f}x apart, over the {cand_spread:g}x allowed for the same work) while "
                    "eager held steady: something disturbed its batches")
    rs = rounds(eb, cb, max_spread if local else None)
    for side, batches in (("eager", eb), ("ModelNew", cb)):
        w = waits.mean([x.get("waited") for x in batches])
        if w is not None and waits.slowed(w) > max_spread:
            return (f"{side}'s threads waited for a core {w:.0%} of their runnable time over its batches (up to "
                    f"{waits.slowed(w):.2f}x slower than alone, over the {max_spread:g}x allowed): other work holds the "
                    "cores, and a speedup taken now measures that load")
    lf = waits.pairing_factor(eb, cb)
    if lf is not None and lf > max_spread:
        return (f"the machine's load could have moved a round's speedup {lf:.2f}x (over the {max_spread:g}x allowed): "
                "eager's or ModelNew's threads waited for a core through much of their batches while the other's did "
                "not (other work on the machine)")
    apart = rounds_spread(rs)
    if cand_spread is not None and apart is not None and apart > ROUNDS_MAX_SPREAD:
        su = [r.speedup for r in kept_rounds(rs)]
        return (f"the rounds' speedups ranged from {min(su):.3g}x to {max(su):.3g}x ({apart:.1f}x apart, over the "
                f"{ROUNDS_MAX_SPREAD:g}x allowed): no speedup rests on rounds that far apart")
    now, then = run["eager"]["median_ms"], max(b.eager.median_ms, 1e-9)
    if drift and now > max_drift * then:
        return (f"eager took {now:.4g} ms a call in every round, {now / then:.2f}x the {then:.4g} ms its baseline "
                f"took on this machine (over the {max_drift:g}x allowed): something else is using it now")
    return None


def rounds_spread(rs: list[PairedRound]) -> float | None:
    """The fastest counted round's speedup over the slowest's: an honest kernel's rounds agree within eager's and its
    own allowances; rounds orders of magnitude apart (0.0003x beside 0.31x) say the machine moved, not the kernel."""
    s = [r.speedup for r in kept_rounds(rs)]
    if len(s) < 2 or any(x is None or x <= 0 for x in s):
        return None
    return max(s) / min(s)  # type: ignore[type-var, operator]


def retimes_baseline(eager_now_ms: float, b: BaselineTimes, cfg: ProfileConfig) -> bool:
    """Whether profile measures the baseline again after a pairing whose eager took `eager_now_ms` a call (the
    stop rule asks too: the thresholds move with the baseline). Eager faster now than the baseline measured it,
    by more than baseline_max_drift: the baseline was measured under load, its compile ratio (and on CUDA its
    calibration) too. Not for a launch-bound task: a few microseconds of launch latency move by that much from
    process to process (seen on the H100), its compile ratio earns nothing, and re-timing it (torch.compile
    included) would cost every such profile seconds of exclusive device time."""
    return eager_now_ms * cfg.baseline_max_drift < b.eager.median_ms and not is_launch_bound(b.eager, cfg)


def speedup(rs: list[PairedRound]) -> tuple[float | None, tuple[float, float] | None]:
    """The median counted round's speedup, and the slowest and fastest counted round's."""
    s = [r.speedup for r in kept_rounds(rs)]
    if not s or any(x is None for x in s):
        return None, None
    return statistics.median(s), (min(s), max(s))


def first_bound(run: dict, b: BaselineTimes, backend: str) -> TimingBound:
    """The timing bound of the first pairing. On the CPU, o is calibrated on the pairing's own eager batches
    (the same moment as the candidate's). On CUDA the candidate's calls run under the kernel audit's profiler
    and the pairing's eager does not (its times stay clean), so o comes from the baseline's audited eager run."""
    cand, eager = run["candidate"], run["eager"]
    a = min(cand["round_trip_ms"], eager["round_trip_ms"])
    if backend == "cuda" and not all(x.get("stream") for x in eager["batches"]):
        cal = b.calibration or b.eager
        a = min(a, cal.round_trip_ms or math.inf)
        o = timing_bound.calibrate([x.model_dump() for x in cal.batches], cal.round_trip_ms or 0.0)
    else:
        o = timing_bound.calibrate(eager["batches"], eager["round_trip_ms"])
    return TimingBound(**timing_bound.check(cand["batches"], a, o, backend))


def add_steps(prev: dict, run: dict) -> None:
    """A re-pairing's `steps` (pair()'s) with the earlier pairings' added: the profile's timing_* phases are
    what all of them took."""
    steps = {k: v + run["steps"].get(k, 0.0) for k, v in prev.get("steps", {}).items()}
    run["steps"] = {**run["steps"], **steps}


def again(eager_w, cand_w, prev: dict, tcfg: dict, timeout: float, backend: str, spot_checks: int,
          top: int) -> tuple[dict, TimingBound]:
    """Pair again, after a pairing that was noisy or failed the bound, and check the candidate against the
    larger of two fresh calibrations (a loaded machine slows the harness's per-call work too): on the CPU the
    previous and this pairing's eager batches, on CUDA eager runs under the audit's profiler before and after."""
    cuda = backend == "cuda"
    audited = {**tcfg, "audited_calibration": True}
    cals = [prev["eager"]]
    t = time.perf_counter()
    if cuda:
        with paused(cand_w.proc.pid), _eager_side():
            cals = [timing_bound.measure(eager_w, "eager", new_seed(), audited, timeout, "re-calibrating on eager")]
    recal = time.perf_counter() - t
    run = pair(eager_w, cand_w, new_seed(), tcfg, timeout, spot_checks, top)
    t = time.perf_counter()
    if cuda:
        with paused(cand_w.proc.pid), _eager_side():
            cals.append(timing_bound.measure(eager_w, "eager", new_seed(), audited, timeout, "re-calibrating on eager"))
    else:
        cals.append(run["eager"])
    # this pairing's steps added to the earlier ones', and the calibrations around it
    add_steps(prev, run)
    run["steps"]["recalibrate"] = run["steps"].get("recalibrate", 0.0) + recal + time.perf_counter() - t
    a = min([run["candidate"]["round_trip_ms"], run["eager"]["round_trip_ms"]] + [x["round_trip_ms"] for x in cals])
    o = max(timing_bound.calibrate(x["batches"], x["round_trip_ms"]) for x in cals)
    return run, TimingBound(**timing_bound.check(run["candidate"]["batches"], a, o, backend), recalibrated=True)
