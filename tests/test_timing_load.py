"""Timings that load cannot skew (issues 65, 68 and 69): the run-queue waits read around each batch, the rules that
turn them and the rounds into `timing_noisy`, torch.compile's baseline checked like eager's, and speed milestones
resting on a confidence bound. Pure decision functions on scripted inputs; no timing thresholds."""

from __future__ import annotations

import os
import random
import statistics
import threading

import pytest

from conftest import scripted_baseline
from sandbox.config import ProfileConfig, RewardConfig
from sandbox.results import (
    CompileResult,
    PairedRound,
    PairedTiming,
    ProfileResult,
    Reason,
    Timing,
    VerifyResult,
)
from sandbox.reward import milestone_reward
from sandbox.timing import baseline, paired, scoring, waits

CFG = ProfileConfig()
C = CompileResult(ok=True, backend="cpu", duration_s=1)
V = VerifyResult(ok=True, backend="cpu", atol=0.01, rtol=0.01, duration_s=1)


# ---- the waits --------------------------------------------------------------------------------------------------


def test_a_sample_reads_every_thread_of_the_tree_and_a_share_is_wait_over_runnable_time():
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        got = waits.sample(os.getpid())
        tids = {tid for pid, tid in got} if got else set()
        assert got is not None and {os.getpid(), t.native_id} <= tids
    finally:
        stop.set()
        t.join()
    assert waits.sample(-1) is None and waits.sample(0) is None  # a scripted timer's pid: nothing read
    before = {(1, 1): (100, 50), (1, 2): (10, 10), (1, 3): (5, 5)}
    # thread 2 ran 90 and waited 30 more, thread 3 ended (its time lost), thread 4 started: 60 ran, 60 waited
    after = {(1, 1): (100, 50), (1, 2): (100, 40), (1, 4): (60, 60)}
    assert waits.waited(before, after) == pytest.approx(90 / 240)
    assert waits.waited(before, before) == 0.0 and waits.waited(None, after) is None


def test_a_share_bounds_how_far_a_batch_and_a_ratio_moved():
    assert waits.slowed(0.0) == 1.0 and waits.slowed(0.5) == pytest.approx(2.0) and waits.slowed(None) == 1.0
    assert waits.slowed(0.99) == pytest.approx(100.0)  # a hundredth of a core: the 120x
    assert waits.load_factor(0.5, 0.5) == pytest.approx(1.0)  # both sides slowed alike: the ratio holds
    assert waits.load_factor(0.0, 0.5) == waits.load_factor(0.5, 0.0) == pytest.approx(2.0)
    assert waits.load_factor(None, 0.5) is None


def _batches(ms: list[float], waited: list[float] | None = None) -> list[dict]:
    out = [{"reported_median_ms": m, "ms": m, "calls": 10, "wall_ms": 10 * m, "reported_mean_ms": m} for m in ms]
    for b, w in zip(out, waited or [], strict=False):
        b["waited"] = w
    return out


def _run(eager: list[float], cand: list[float], ew: list[float] | None = None, cw: list[float] | None = None) -> dict:
    return {"eager": {"median_ms": statistics.median(eager), "batches": _batches(eager, ew)},
            "candidate": {"batches": _batches(cand, cw)}}


def _noise(run: dict) -> str | None:
    return paired.noise(run, scripted_baseline(1.0), CFG.noise_max_spread, CFG.baseline_max_drift,
                        cand_spread=CFG.candidate_max_spread)


def test_a_candidate_slowed_through_every_batch_by_another_clients_load_is_noise():
    """Issue 69's case: a task check spinning four threads beside a profile; the candidate's OpenMP threads waited
    at every barrier and its batches, steady among themselves, took 120x its time alone, while eager's single
    thread kept a core. Every earlier rule let it score (0.0083x); its waits do not."""
    eager, cand = [1.0] * 6, [120.0] * 5
    assert _noise(_run(eager, cand)) is None  # without the waits: scored
    why = _noise(_run(eager, cand, [0.0] * 6, [0.99] * 5))
    assert why is not None and "load" in why, why
    # the same light load on both sides moves no ratio: scored
    assert _noise(_run(eager, [0.5] * 5, [0.3] * 6, [0.3] * 5)) is None
    # a heavy one is not scored, even alike: eager's OpenMP barriers lose more than its waits say (an honest kernel at
    # about 1x eager read 2.29x on this CPU under a load average of 10, its load factor 1.31)
    why = _noise(_run(eager, [0.5] * 5, [0.6] * 6, [0.6] * 5))
    assert why is not None and "waited for a core 60%" in why, why
    # eager's threads waiting where a single-threaded candidate did not (load favouring the candidate): noise
    assert _noise(_run([2.0] * 6, [1.0] * 5, [0.5] * 6, [0.0] * 5)) is not None
    assert waits.pairing_factor(_batches([1.0] * 6, [0.0] * 6), _batches([1.0] * 5, [0.5] * 5)) == pytest.approx(2.0)


def test_rounds_an_order_of_magnitude_apart_are_not_scored():
    """Issue 65's 0.0003x: no speedup from rounds that disagree by orders of magnitude, even when each step between
    consecutive candidate batches stays inside candidate_max_spread."""
    eager = [1.0] * 6
    creeping = [0.1, 0.29, 0.84, 2.4, 7.0]  # under 3x a step, 70x over the pairing
    why = _noise(_run(eager, creeping))
    assert why is not None and "apart" in why and "10x allowed" in why, why
    rs = paired.rounds(_batches(eager), _batches(creeping))
    assert paired.rounds_spread(rs) == pytest.approx(70.0)
    assert _noise(_run(eager, [0.1, 0.2, 0.4, 0.8, 0.9])) is None  # 9x: inside an order of magnitude


# ---- the speed milestones on a confidence bound ---------------------------------------------------------------


def _profile(speedups: list[float], compile_ratio: float | None = None, lb: bool = False) -> ProfileResult:
    rounds = [PairedRound(eager_before_ms=s, candidate_ms=1.0, eager_after_ms=s, speedup=s) for s in speedups]
    se, lo, hi = statistics.median(speedups), min(speedups), max(speedups)
    pt = PairedTiming(rounds=rounds, eager_spread=1.0, noisy=False, baseline_eager_ms=1.0, eager_drift=1.0)
    r = compile_ratio
    return ProfileResult(ok=True, backend="cpu", compile_mode="default", duration_s=1, paired=pt, launch_bound=lb,
                         speedup_vs_eager=se, speedup_vs_eager_range=(lo, hi),
                         speedup_vs_compile=se * r if r else None,
                         speedup_vs_compile_range=(lo * r, hi * r) if r else None)


def test_a_kernel_at_about_eager_speed_earns_nothing_from_its_median():
    # issue 68: a ReLU whose cached torch.compile read 2-2.7x slower than eager, an honest kernel at 1.036x: reward 3
    near = [1.04, 1.036, 0.98, 1.05, 1.02]
    old = ProfileResult(**{**_profile(near, 2.3).model_dump(), "paired": None, "speedup_vs_eager_range": None,
                           "speedup_vs_compile_range": None})
    assert milestone_reward(C, V, old).reward == 3  # the point estimate alone: what the issue saw
    assert milestone_reward(C, V, _profile(near, 2.3)).milestone == "correct"
    # every round above: the milestones stand
    assert milestone_reward(C, V, _profile([1.3, 1.25, 1.4, 1.28, 1.35], 2.3)).milestone == "faster_than_compile"
    assert milestone_reward(C, V, _profile([1.3, 1.25, 1.4, 1.28, 1.35], 0.5)).milestone == "faster_than_eager"
    # a profile that computed its own interval and kept no rounds (a record from elsewhere): its lower end counts
    ci = ProfileResult(**{**old.model_dump(), "speedup_vs_eager_ci": (0.98, 1.05), "speedup_vs_compile_ci": (2.2, 2.4)})
    assert milestone_reward(C, V, ci).milestone == "correct"
    # rounds left out (CUDA's disturbed rounds) do not count towards the bound
    p = _profile([1.3, 1.25, 1.4, 1.28, 0.5])
    p.paired.rounds[-1].counted = False
    assert milestone_reward(C, V, p).milestone == "faster_than_eager"


def test_an_honest_kernel_at_eager_speed_rarely_earns_a_speed_milestone():
    """Monte Carlo of a kernel exactly as fast as eager, its five rounds each off by a few percent: the median wins
    faster_than_eager about half the time, the 95% bound about 1 in 32 (every round above 1.0)."""
    rng = random.Random(68)
    trials = [[rng.gauss(1.0, 0.03) for _ in range(5)] for _ in range(4000)]
    old = sum(statistics.median(t) > 1.0 for t in trials) / len(trials)
    new = sum(milestone_reward(C, V, _profile(t, 2.3)).reward >= 2 for t in trials) / len(trials)
    assert 0.45 < old < 0.55 and 0.02 < new < 0.045, (old, new)


# ---- torch.compile's baseline, checked like eager's ---------------------------------------------------------


def _timing(ms: float, waited: float | None = None, spread: float = 1.0) -> dict:
    t = Timing(median_ms=ms, mean_ms=ms, std_ms=0, min_ms=ms, max_ms=ms, iqr_ms=0, trials=10, input_sets=10)
    return {**t.model_dump(), "batches": _batches([ms, ms * spread, ms], [waited] * 3 if waited is not None else None)}


def _scripted(script: dict[str, list[dict]]):
    """measure(variant) for baseline.compile_timed, answering each variant's timings in turn."""
    its = {k: iter(v) for k, v in script.items()}
    asked: list[str] = []

    def measure(variant: str):
        def once() -> dict:
            asked.append(variant)
            return next(its[variant])
        return once
    return measure, asked


def test_a_torch_compile_timed_under_load_is_timed_again_and_the_clean_one_kept():
    """Issue 65's case: torch.compile's batches ran 6-8 ms under load where it takes 1.6-1.9 ms (eager 2.9)."""
    cfg = ProfileConfig(retime_max=2)
    measure, asked = _scripted({"compiled": [_timing(7.8, 0.75), _timing(1.7, 0.0)],
                                "eager": [_timing(2.9, 0.0), _timing(2.9, 0.0)]})
    compiled, checks = baseline.compile_timed(measure, _timing(2.9, 0.0), cfg)
    # the loaded attempt (its waits could have moved its ratio 4x) was timed again
    assert compiled["median_ms"] == 1.7 and asked == ["compiled", "eager", "compiled", "eager"]
    assert compiled["retimed"] == 1 and checks["attempts"] == 2
    assert checks["ratio"] == pytest.approx(1.7 / 2.9) and baseline.compile_noise(checks, cfg) is None


def test_torch_compile_slower_than_eager_is_timed_again_and_the_faster_kept():
    cfg = ProfileConfig(retime_max=2)
    measure, asked = _scripted({"compiled": [_timing(7.0), _timing(2.0)], "eager": [_timing(2.8), _timing(2.9)]})
    compiled, checks = baseline.compile_timed(measure, _timing(2.9), cfg)
    assert asked == ["compiled", "eager", "compiled", "eager"] and checks["attempts"] == 2
    assert compiled["median_ms"] == 2.0 and checks["ratio"] == pytest.approx(2.0 / 2.85)
    # confirmed slower twice: the smaller ratio stands (a fair bar: load only slows torch.compile down)
    measure, _ = _scripted({"compiled": [_timing(7.0), _timing(6.0)], "eager": [_timing(2.9), _timing(2.9)]})
    compiled, checks = baseline.compile_timed(measure, _timing(2.9), cfg)
    assert compiled["median_ms"] == 6.0 and checks["attempts"] == 2


def test_a_torch_compile_figure_that_stays_noisy_says_why():
    cfg = ProfileConfig(retime_max=1)
    moved = {"compiled": [_timing(1.0), _timing(1.0)], "eager": [_timing(4.0), _timing(8.0)]}  # eager moved 2-4x
    measure, _ = _scripted(moved)
    _, checks = baseline.compile_timed(measure, _timing(2.0), cfg)
    assert checks["attempts"] == 2 and "eager moved" in baseline.compile_noise(checks, cfg)
    measure, _ = _scripted({"compiled": [_timing(1.0, spread=3.0)] * 2, "eager": [_timing(2.0)] * 2})
    _, checks = baseline.compile_timed(measure, _timing(2.0), cfg)
    assert "batches were 3.00x apart" in baseline.compile_noise(checks, cfg)
    # eager quiet, torch.compile's threads waiting through its batches: its ratio could have moved 4x
    measure, _ = _scripted({"compiled": [_timing(1.0, 0.75)] * 4, "eager": [_timing(2.0, 0.0)] * 2})
    _, checks = baseline.compile_timed(measure, _timing(2.0, 0.0), cfg)
    assert "load" in baseline.compile_noise(checks, cfg) and checks["load"] == pytest.approx(4.0)
    assert baseline.compile_noise(None, cfg) is None  # a record from before the checks


def test_an_eager_baseline_under_load_is_timed_again():
    cfg = ProfileConfig(retime_max=2)
    runs = iter([_timing(8.0, 0.8), _timing(2.0, 0.0), _timing(9.0, 0.9)])
    got = baseline.time_with_retime(lambda: next(runs), cfg)
    assert got["median_ms"] == 2.0 and got["retimed"] == 1
    assert baseline.loaded(_timing(8.0, 0.8), cfg) and not baseline.loaded(_timing(2.0, 0.2), cfg)


# ---- a profile whose milestone would rest on a noisy torch.compile figure -------------------------------------


class _Run:
    """What scoring.scored reads of a profile in the making (sandbox/timing/profile.py's ProfileRun), its baseline
    measured again from `again` when asked."""

    def __init__(self, b, again=None):
        self.cfg, self.b, self.again, self.refreshed = CFG, b, again, []
        self.out: dict = {"eager": Timing(**_timing(1.0)), "candidate": Timing(**_timing(0.5))}

    def result(self, ok: bool, reason=None, message: str = "") -> ProfileResult:
        return ProfileResult(ok=ok, reason=reason, message=message, backend="cpu", compile_mode="default",
                             duration_s=1, **self.out)

    def baseline(self, refresh=None):
        self.refreshed.append(refresh)
        self.b = self.again
        return None


def _with_compile(checks: dict | None):
    b = scripted_baseline(1.0)
    return b.model_copy(update={"compiled": Timing(**_timing(2.5)), "compile_checks": checks})


NOISY = {"eager_moved": 2.5, "spread": 1.0, "load": 1.0, "ratio": 2.5, "attempts": 3}
CLEAN = {"eager_moved": 1.0, "spread": 1.0, "load": 1.0, "ratio": 0.8, "attempts": 1}


def _full(run: dict) -> dict:
    """A scripted run whose eager side carries every Timing field, as timing_bound.Run.end gives it."""
    return {**run, "eager": {**_timing(run["eager"]["median_ms"]), "batches": run["eager"]["batches"]}}


def _pairing(pr: _Run, cand_ms: float) -> dict:
    """The pairing of eager at 1 ms and the candidate at `cand_ms`, recorded in `pr` as profile's _timed does."""
    pairing = scoring.pairing_of(_full(_run([1.0] * 6, [cand_ms] * 5)), 1, pr.b, CFG, "cpu")
    pr.out["paired"] = scoring.paired_record(pairing, pr.b)
    return pairing


def test_a_milestone_on_a_noisy_torch_compile_figure_measures_it_again_or_is_not_scored():
    # twice as fast as eager, torch.compile's figure noisy: measured again, still noisy: timing_noisy (reward 1)
    pr = _Run(_with_compile(NOISY), again=_with_compile(NOISY))
    p = scoring.scored(pr, _pairing(pr, 0.5))
    assert pr.refreshed == ["compile"] and not p.ok and p.reason == Reason.timing_noisy, p.message
    assert "torch.compile" in p.message and milestone_reward(C, V, p).reward == 1
    # measured again clean: scored on the new figure
    pr = _Run(_with_compile(NOISY), again=_with_compile(CLEAN))
    p = scoring.scored(pr, _pairing(pr, 0.5))
    assert pr.refreshed == ["compile"] and p.ok and p.speedup_vs_compile == pytest.approx(2.0 * 0.8)
    assert p.speedup_vs_eager_ci == (pytest.approx(2.0), pytest.approx(2.0))
    # slower than eager: no milestone rests on torch.compile's figure, nothing measured again
    pr = _Run(_with_compile(NOISY))
    p = scoring.scored(pr, _pairing(pr, 2.0))
    assert pr.refreshed == [] and p.ok and milestone_reward(C, V, p).milestone == "correct"


def test_the_pairing_record_keeps_its_load_and_rounds_spread():
    run = _full(_run([1.0] * 6, [0.5] * 5, [0.0] * 6, [0.2] * 5))
    rec = scoring.paired_record(scoring.pairing_of(run, 1, scripted_baseline(1.0), CFG, "cpu"), scripted_baseline(1.0))
    assert rec.load_factor == pytest.approx(1.25) and rec.rounds_spread == pytest.approx(1.0)
    assert rec.waited == (pytest.approx(0.0), pytest.approx(0.2))
    assert RewardConfig().speedup_confidence == 0.95


# ---- end to end, on a loaded CPU ------------------------------------------------------------------------------


def _spin() -> None:
    while True:
        pass


@pytest.mark.full  # a real profile beside spinning processes; the rules it rests on: the scripted tests above
def test_a_profile_beside_spinning_processes_is_noisy_or_scores_the_milestone_it_earns_alone(cpu_ws):
    """Two processes spinning beside the judge (a core each on CI's two), as the issue's task check did: each profile of the fixture's
    scalar loop (several times slower than eager alone) is timing_noisy or `correct`, never a speed milestone, and
    the judge read every timed batch's waits. No timing threshold: which of the two it is depends on the machine."""
    import multiprocessing as mp

    from conftest import set_variant
    from sandbox.api import profile_workspace

    set_variant(cpu_ws.root, "correct")
    quick = ProfileConfig(target_ms=100, max_trials=30, warmup_ms=12, top_kernels=0)
    load = [mp.get_context("fork").Process(target=_spin, daemon=True) for _ in range(2)]
    for p in load:
        p.start()
    try:
        profiles = [profile_workspace(cpu_ws, quick) for _ in range(2)]
    finally:
        for p in load:
            p.kill()
            p.join()
    outcomes = [p.reason if not p.ok else milestone_reward(C, V, p).milestone for p in profiles]
    assert set(outcomes) <= {Reason.timing_noisy, "correct"}, [(p.reason, p.message) for p in profiles]
    timed = [p for p in profiles if p.candidate is not None and p.eager is not None]
    assert timed and all(b.waited is not None for p in timed for b in p.eager.batches + p.candidate.batches)
