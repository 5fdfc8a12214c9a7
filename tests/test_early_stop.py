"""Stopping the paired timing early (docs/judge.md, "Stopping the paired timing early"): the decision rule on
constructed rounds, the pairing driven by scripted timers, and real profiles of real workers on the CPU."""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import shutil
import statistics

import pytest

from conftest import FIXTURES, ScriptedTimer, profile_scored, scripted_baseline, set_variant
from sandbox.api import init_workspace, milestone_reward, verify_workspace
from sandbox.config import ProfileConfig, RewardConfig, VerifyConfig
from sandbox.results import CompileResult, PairedRound, PairedTiming, ProfileResult, VerifyResult
from sandbox.reward import lower_rank, speedup_bounds
from sandbox.timing import baseline, early_stop, paired, profile
from sandbox.timing.baseline import timing_cfg
from sandbox.timing.early_stop import decide, guaranteed_rounds, milestone_bands
from sandbox.timing.profile import _paired, device_identity

QUICK = ProfileConfig(target_ms=100, max_trials=30, warmup_ms=12, top_kernels=0, noise_max_spread=3.0)
R = RewardConfig()
C = CompileResult(ok=True, backend="cpu", duration_s=1)
V = VerifyResult(ok=True, backend="cpu", atol=0.01, rtol=0.01, duration_s=1)


def milestone(speedups: list[float], ratio: float | None, launch_bound: bool, reward: RewardConfig = R) -> str:
    """The milestone sandbox/reward.py gives these rounds: the lower end of their median's confidence interval
    against each threshold (torch.compile's through the ratio's lower end, here ratio x 0.9)."""
    se, lo, hi = statistics.median(speedups), min(speedups), max(speedups)
    rounds = [PairedRound(eager_before_ms=s, candidate_ms=1.0, eager_after_ms=s, speedup=s) for s in speedups]
    pt = PairedTiming(rounds=rounds, eager_spread=1.0, noisy=False, baseline_eager_ms=1.0, eager_drift=1.0)
    p = ProfileResult(ok=True, backend="cpu", compile_mode="default", duration_s=1, speedup_vs_eager=se,
                      speedup_vs_eager_range=(lo, hi), paired=pt,
                      speedup_vs_compile=se * ratio if ratio is not None else None,
                      speedup_vs_compile_range=(lo * ratio * 0.9, hi * ratio * 1.1) if ratio is not None else None,
                      launch_bound=launch_bound)
    return milestone_reward(C, V, p, reward).milestone


# ---- the decision on constructed rounds -------------------------------------------------------------------


def test_the_confidence_bound_is_a_binomial_order_statistic():
    # the r-th slowest of n rounds bounds the median from below at 95% when P(Binomial(n, 1/2) <= r - 1) <= 5%
    assert [lower_rank(n, 0.95) for n in (1, 3, 5, 6, 10, 20)] == [1, 1, 1, 1, 2, 6]
    assert speedup_bounds([1.3, 0.9, 1.1, 1.0, 1.2], 0.95) == (0.9, 1.3)  # five rounds: the slowest and fastest
    assert speedup_bounds(list(range(1, 21)), 0.95) == (6, 15)
    assert speedup_bounds([], 0.95) is None


def test_rounds_decide_only_what_the_full_budget_would_give():
    bands = milestone_bands(R, False, None, None)
    assert bands == [(1.0, 1.0)]
    # at or below the threshold: the slowest round already keeps the bound below it, whatever comes
    assert decide([0.2, 0.3, 0.25], bands, 0.0, 5) == "decided"
    assert decide([1.0, 0.9, 0.95], bands, 0.0, 5) == "decided"
    assert decide([1.0, 1.1, 1.2], bands, 0.0, 5) == "decided"  # a round at the threshold: not faster
    # every round above: two rounds still to come could be slower, so the full budget runs (five at 95%: the
    # slowest round decides), unless none are left
    assert decide([2.0, 2.5, 3.0], bands, 0.0, 5) is None
    assert decide([2.0, 2.5, 3.0, 2.2, 2.4], bands, 0.0, 5) == "decided"
    assert decide([2.0, 2.5, 3.0], bands, 0.0) == "decided"
    # a larger budget bounds by its second slowest round: one round at or below is not yet enough
    assert decide([0.9, 1.1, 1.2, 1.3, 1.4, 1.5], bands, 0.0, 10) is None
    assert decide([0.9, 0.95, 1.2, 1.3, 1.4, 1.5], bands, 0.0, 10) == "decided"
    assert decide([0.9, None, 1.2], bands, 0.5, 5) is None  # a round without a speedup decides nothing
    assert decide([], bands, 0.5) is None


def test_rounds_that_agree_within_the_tolerance_stop_with_a_threshold_among_them():
    bands = milestone_bands(R, False, None, None)
    straddling = [0.995, 1.005, 1.01, 1.002, 1.003, 1.004]
    assert decide(straddling, bands, 0.02, 10) == "tight"
    assert decide(straddling, bands, 0.0, 10) is None
    assert decide([0.95, 1.05, 1.04, 1.01, 1.02, 1.03], bands, 0.02, 10) is None  # 10% apart
    # never with every round above a threshold the full budget could still fall below
    assert decide([1.01, 1.012, 1.015, 1.011, 1.013, 1.014], bands, 0.02, 10) is None


def test_bands_come_from_the_reward_settings():
    # launch-bound: faster_than_eager needs the larger margin, torch.compile does not count
    assert milestone_bands(R, True, 0.5, (0.4, 0.6)) == [(1.1, 1.1)]
    counts = R.model_copy(update={"launch_bound_counts": True})
    assert len(milestone_bands(counts, True, 0.5, (0.4, 0.6))) == 2
    # torch.compile at half eager's time: speedup_vs_compile > 1.05 means speedup_vs_eager > 2.1, and the ratio's
    # quartile range 0.4-0.6 makes that 1.75-2.625
    (te, _), (lo, hi) = milestone_bands(R, False, 0.5, (0.4, 0.6))
    assert te == 1.0 and lo == pytest.approx(1.05 / 0.6) and hi == pytest.approx(1.05 / 0.4)
    # a milestone rests on the ratio's lower end: the band's top is torch.compile's threshold
    assert decide([3.0, 3.2, 2.9], milestone_bands(R, False, 0.5, (0.4, 0.6)), 0.0) == "decided"
    assert decide([2.0, 2.2, 1.9], milestone_bands(R, False, 0.5, (0.4, 0.6)), 0.0) == "decided"
    assert decide([2.0, 2.2, 1.9], milestone_bands(R, False, 0.5, (0.4, 0.6)), 0.0, 5) is None
    # torch.compile slower than eager: its threshold is below eager's, so only eager's matters
    assert milestone_bands(R, False, 2.0, (1.8, 2.2))[1] == (1.0, 1.0)
    # a ratio range reaching 0 (a compiled timing whose quartiles reach 0): no speedup clears the band's top
    assert milestone_bands(R, False, 0.5, (0.0, 0.6))[1][1] == math.inf


@pytest.mark.parametrize("k", [3, 4, 5, 6, 7])
def test_a_decided_stop_gives_the_full_budgets_milestone_whatever_the_rounds_it_skipped(k):
    """The exactness the rule rests on, checked over random rounds and every completion pattern: once a majority
    of the K rounds ran and the rule says decided, the rounds so far and all K rounds get the same milestone (each
    from its confidence bound), for any values of the rounds not run (far below, far above, between)."""
    rng = random.Random(k)
    m0 = guaranteed_rounds(ProfileConfig(timing_batches=k, min_rounds=1))
    assert m0 == k // 2 + 1
    stopped = 0
    for _ in range(200):
        ratio = rng.choice([None, 0.3, 0.8, 2.0])
        lb = rng.random() < 0.3
        bands = milestone_bands(R, lb, ratio, None if ratio is None else (ratio * 0.9, ratio * 1.1))
        rounds = [rng.uniform(0.5, 4.0) for _ in range(k)]
        for m in range(m0, k):
            if decide(rounds[:m], bands, 0.0, k) != "decided":
                continue
            stopped += 1
            early = milestone(rounds[:m], ratio, lb)
            for rest in itertools.product([0.01, 1.0, 2.5, 100.0], repeat=k - m):
                assert milestone(rounds[:m] + list(rest), ratio, lb) == early, (rounds[:m], rest, bands)
    assert stopped > 50


def test_fewer_rounds_than_a_majority_would_not_be_exact():
    """Why the minimum is a majority: two rounds above the threshold of five, three below, is not faster."""
    assert guaranteed_rounds(ProfileConfig(timing_batches=5, min_rounds=1)) == 3
    assert guaranteed_rounds(ProfileConfig(timing_batches=5, min_rounds=4)) == 4
    assert guaranteed_rounds(ProfileConfig(timing_batches=2, min_rounds=9)) == 2
    assert decide([1.5, 1.6], milestone_bands(R, False, None, None), 0.0) == "decided"
    assert milestone([1.5, 1.6], None, False) == "faster_than_eager"
    assert milestone([1.5, 1.6, 0.5, 0.5, 0.5], None, False) == "correct"


def test_a_stop_holds_the_aggregate_check_as_tightly_as_the_full_budget():
    """A forger that leaves each batch's work running into the next shows (m-1)/m of its real time over m
    batches: over three it would pass the aggregate check at 2.1x its reported time, which over five (the full
    budget, same strategy) fails. The stop asks for the five-batch allowance, so it times on instead."""
    from sandbox.results import TimingBound
    from sandbox.timing import timing_bound

    def bound(walls: list[float]) -> TimingBound:
        batches = [{"calls": 100, "wall_ms": w, "reported_mean_ms": 1.0, "reported_median_ms": 1.0} for w in walls]
        return TimingBound(**timing_bound.check(batches, 0.0, 0.0, "cpu"))

    forger3, forger5 = bound([0.0, 210.0, 210.0]), bound([0.0] + [210.0] * 4)
    assert forger3.ok and not forger5.ok
    assert not early_stop.as_tight_as_the_full_budget(forger3, 5)
    assert early_stop.as_tight_as_the_full_budget(bound([105.0] * 3), 5)  # honest, 5% over its reported time
    assert early_stop.as_tight_as_the_full_budget(forger5, 5)  # at the full budget the plain check alone decides


# ---- the pairing, driven by scripted timers -----------------------------------------------------------------


def _pair(cand_ms, cfg: ProfileConfig = QUICK, eager_ms=lambda i: 1.0):
    eager, cand = ScriptedTimer(eager_ms), ScriptedTimer(cand_ms)
    run, bound, attempts = _paired(eager, cand, scripted_baseline(), timing_cfg(cfg), cfg, "cpu")
    assert bound.ok
    return run, attempts, cand


def _speedups(run) -> list[float]:
    return [r.speedup for r in paired.rounds(run["eager"]["batches"], run["candidate"]["batches"])]


def test_a_clear_verdict_stops_after_the_minimum_rounds_and_checks_every_batch_alike(unpaused):
    run, attempts, cand = _pair(lambda i: 4.0)  # four times slower than eager
    assert (run["stopped"], len(run["candidate"]["batches"]), len(run["eager"]["batches"]), attempts) == \
        ("decided", 3, 4, 1)
    # every batch that ran was asked for the same spot-check rate (nothing tells a checked batch from another),
    # which puts the configured number of checks, on average, in the batches every timing runs
    calls = run["candidate"]["batches"][0]["calls"]
    assert len(cand.spots) == 3 and len(set(cand.spots)) == 1
    assert cand.spots[0] * QUICK.min_rounds * (calls - 1) == pytest.approx(QUICK.spot_checks)
    full, _, _ = _pair(lambda i: 4.0, QUICK.model_copy(update={"early_stop": False}))
    assert full["stopped"] == "max_rounds" and len(full["candidate"]["batches"]) == QUICK.timing_batches
    # four times faster: every round so far above the threshold, and the rounds to come could still pull the
    # bound below it, so a faster candidate is timed over the full budget and scored on all of it
    fast, _, _ = _pair(lambda i: 0.25)
    assert fast["stopped"] == "max_rounds" and len(fast["candidate"]["batches"]) == QUICK.timing_batches


def test_a_speedup_near_the_threshold_stops_only_where_the_full_budget_would_agree(unpaused):
    at = QUICK.model_copy(update={"stop_tolerance": 0.0, "timing_batches": 10})
    # one round at 0.98x, the rest at 1.01x: of ten rounds the second slowest bounds the median, so one round below
    # the threshold does not settle it, and the timing runs its budget
    script = lambda i: 1.0 / 0.98 if i == 0 else 1.0 / 1.01  # noqa: E731
    run, _, _ = _pair(script, at)
    assert run["stopped"] == "max_rounds" and len(run["candidate"]["batches"]) == 10
    # the same rounds within a 5% tolerance: the timing cannot settle them, and stops
    run, _, _ = _pair(script, at.model_copy(update={"stop_tolerance": 0.05}))
    assert run["stopped"] == "tight" and len(run["candidate"]["batches"]) == 6
    # two rounds at or below it in the budget of ten: not faster, whatever follows
    run, _, _ = _pair(lambda i: 1.0 / 0.98 if i < 2 else 1.0 / 1.01, at)
    assert run["stopped"] == "decided" and len(run["candidate"]["batches"]) == 6


def test_fast_first_and_slow_later_gains_nothing_from_the_stop(unpaused):
    """A candidate fast in its first rounds and slow later: no stop while its rounds are above the threshold, and its
    first slow round decides it is not faster (the full budget's bound is its slowest round). Slow first and fast
    later: decided on the slow ones."""
    script = lambda i: 0.5 if i < 3 else 2.0  # noqa: E731
    # the jump between its third and fourth rounds is itself noise (candidate_max_spread): the stop is looked at
    # here with that rule out of the way
    wide = QUICK.model_copy(update={"candidate_max_spread": 100.0})
    early, _, _ = _pair(script, wide)
    assert early["stopped"] == "decided" and _speedups(early) == [2.0, 2.0, 2.0, 0.5]
    assert milestone(_speedups(early), None, False) == "correct"
    late, _, _ = _pair(lambda i: 2.0 if i < 2 else 0.5, wide)
    assert late["stopped"] == "decided" and _speedups(late) == [0.5, 0.5, 2.0]
    assert milestone(_speedups(late), None, False) == "correct"


def test_noisy_rounds_stop_early_and_so_does_the_retry(unpaused):
    """Noise is paired again as the first time, stop rule included: eager that stays noisy ends the retry at the
    minimum too (more rounds cannot narrow the spread), and the profile is left unscored sooner."""
    cfg = QUICK.model_copy(update={"noise_max_spread": 1.5, "noise_retries": 1})
    run, attempts, _ = _pair(lambda i: 0.5, cfg, eager_ms=lambda i: 1.0 if i % 2 else 2.0)
    assert attempts == 2 and run["stopped"] == "noisy" and len(run["candidate"]["batches"]) == 3
    # a retry on a machine that has calmed down is decided in the minimum as well
    run, attempts, _ = _pair(lambda i: 2.0, cfg, eager_ms=lambda i: (1.0 if i % 2 else 2.0) if i < 4 else 1.0)
    assert attempts == 2 and run["stopped"] == "decided" and len(run["candidate"]["batches"]) == 3


def _cuda_pair(eager_ms, cand_ms, cfg: ProfileConfig = QUICK):
    """A CUDA pairing of scripted timers (the noise rule reads each round's own two eager batches), its bound
    calibrated on a scripted eager whose harness costs nothing."""
    from sandbox.results import Timing

    b = scripted_baseline(eager_ms(0))
    one = {"calls": 10, "wall_ms": 10 * eager_ms(0), "reported_mean_ms": eager_ms(0), "reported_median_ms": eager_ms(0)}
    b.calibration = Timing(**{**b.eager.model_dump(), "round_trip_ms": 0.0, "batches": [one]})
    run, bound, attempts = _paired(ScriptedTimer(eager_ms), ScriptedTimer(cand_ms), b, timing_cfg(cfg), cfg, "cuda")
    assert bound.ok
    return run, attempts, paired.rounds(run["eager"]["batches"], run["candidate"]["batches"], cfg.noise_max_spread)


def test_on_cuda_a_round_the_host_moved_inside_is_left_out_and_the_others_decide(unpaused):
    """The H200's case: a small kernel's host path stepped from 0.027 to 0.0175 ms a call between two batches, for
    eager and the candidate alike. The round with the step inside it was noisy and ended the pairing (and its
    retry); now it is left out, and the rounds either side, each like with like, decide."""
    cfg = QUICK.model_copy(update={"noise_max_spread": 1.5, "noise_retries": 1})
    run, attempts, rounds = _cuda_pair(lambda i: 0.027 if i < 2 else 0.0175, lambda i: 0.025 if i < 2 else 0.016, cfg)
    assert attempts == 1 and run["stopped"] == "decided", run["stopped"]
    assert [r.counted for r in rounds] == [True, False, True, True]
    s, (lo, hi) = paired.speedup(rounds)
    assert (lo, s, hi) == (pytest.approx(1.08), pytest.approx(0.0175 / 0.016), pytest.approx(0.0175 / 0.016))
    # the same rounds on the CPU, where every batch counts: the first pairing was noisy and paired again
    cpu_run, cpu_attempts, _ = _pair(lambda i: 0.025 if i < 2 else 0.016, cfg, eager_ms=lambda i: 0.027 if i < 2 else 0.0175)
    assert cpu_attempts == 2 and "apart" in cpu_run["paired_again_for"][0], cpu_run["paired_again_for"]


def test_on_cuda_a_host_that_keeps_moving_is_still_noisy(unpaused):
    """Rounds are left out only while enough undisturbed ones can remain: eager moving in every round ends the
    pairing at the minimum, and its retry too."""
    cfg = QUICK.model_copy(update={"noise_max_spread": 1.5, "noise_retries": 1})
    run, attempts, rounds = _cuda_pair(lambda i: 1.0 if i % 2 else 2.0, lambda i: 0.5, cfg)
    assert attempts == 2 and run["stopped"] == "noisy" and len(rounds) == guaranteed_rounds(cfg)
    assert not any(r.counted for r in rounds) and paired.speedup(rounds) == (None, None)
    why = paired.noise(run, scripted_baseline(), 1.5, 1.5, local=True, min_kept=guaranteed_rounds(cfg))
    assert "0 undisturbed rounds, fewer than the 3" in why, why


def test_a_candidate_failing_the_bound_so_far_is_timed_to_the_end(unpaused, monkeypatch):
    """The stop needs the timing bound to hold on the batches so far: a candidate whose batches take far longer
    by the judge's clock than it reports is never stopped early, and is judged on the full budget."""
    cand = ScriptedTimer(lambda i: 0.01)
    real = cand.request

    def slow(op, timeout, what, **args):
        if op == "time_batch" and args["calls"]:
            import time

            time.sleep(0.02)  # 20 ms for a batch of 1000 calls by the judge's clock: twice what it reports
        return real(op, timeout, what, **args)

    cand.request = slow
    cfg = QUICK.model_copy(update={"bound_retry_pause_s": 0.0})
    run, bound, attempts = _paired(ScriptedTimer(lambda i: 1.0), cand, scripted_baseline(), timing_cfg(cfg), cfg, "cpu")
    assert not bound.ok and attempts == 1 + cfg.bound_retries == 3 and run["stopped"] == "max_rounds"
    # a failed bound is paired again between two fresh calibrations (paired.again), and judged on them
    assert run["paired_again_for"] == ["timing bound"] * 2 and bound.recalibrated and run["steps"]["recalibrate"] > 0
    assert len(run["candidate"]["batches"]) == QUICK.timing_batches


def test_a_burst_of_another_processs_device_work_costs_a_retry_not_the_verdict(unpaused):
    """Another process's work on the device (outside the judge's scheduling) inflated the judge's clock for an
    honest ReLU in two pairings in a row on the H200 (timing_unverified, -1, in 2 of 8 profiles): the bound is
    tried again, after a pause, and a pairing outside the burst is judged; with retries off the burst decides."""
    import time

    def bursty(burst_pairings: int) -> ScriptedTimer:
        cand = ScriptedTimer(lambda i: 0.01)
        real, begun = cand.request, [0]

        def request(op, timeout, what, **args):
            if op == "time_begin":
                begun[0] += 1
            if op == "time_batch" and args["calls"] and begun[0] <= burst_pairings:
                time.sleep(0.02)  # the burst: twice the batch's reported time by the judge's clock
            return real(op, timeout, what, **args)

        cand.request = request
        return cand

    cfg = QUICK.model_copy(update={"bound_retry_pause_s": 0.01})
    run, bound, attempts = _paired(ScriptedTimer(lambda i: 1.0), bursty(2), scripted_baseline(), timing_cfg(cfg), cfg,
                                   "cpu")
    assert bound.ok and attempts == 3 and run["paired_again_for"] == ["timing bound"] * 2, run["paired_again_for"]
    one = cfg.model_copy(update={"bound_retries": 1})
    run, bound, attempts = _paired(ScriptedTimer(lambda i: 1.0), bursty(2), scripted_baseline(), timing_cfg(one), one,
                                   "cpu")
    assert not bound.ok and attempts == 2


# ---- real profiles on the CPU ---------------------------------------------------------------------------------


def _outcome(p: ProfileResult, cfg: ProfileConfig) -> str:
    assert p.ok, (p.reason, p.message)
    return milestone_reward(C, V, p, cfg.reward).milestone


def test_a_clearly_slower_candidate_stops_early_with_the_full_timings_milestone(cpu_ws, monkeypatch):
    """The fixture's scalar loop is several times slower than eager: three rounds decide it, and a full timing
    of the same kernel gives the same milestone. The spot checks run after the exclusive section, under the
    shared lock (the timing's hold stepped down), and as many as configured."""
    set_variant(cpu_ws.root, "correct")
    held: list[str] = []
    seen: list[list[str]] = []
    real_lock, real_hold, real_spots = profile.device_lock, profile.timing_hold, profile.spot_checks

    @contextlib.contextmanager
    def lock(device, exclusive):
        with real_lock(device, exclusive) as queued:
            held.append("exclusive" if exclusive else "shared")
            try:
                yield queued
            finally:
                held.pop()

    @contextlib.contextmanager
    def hold(device, **kw):
        with real_hold(device, **kw) as h:
            held.append("exclusive")
            share = h.share

            def stepped_down() -> None:
                share()
                held[-1] = "shared"

            h.share = stepped_down
            try:
                yield h
            finally:
                held.pop()

    def spots(*args):
        seen.append(list(held))
        return real_spots(*args)

    monkeypatch.setattr(profile, "device_lock", lock)
    monkeypatch.setattr(profile, "timing_hold", hold)
    monkeypatch.setattr(profile, "spot_checks", spots)
    # a noisy round on a loaded CI machine can keep the rounds from deciding: profiled again, as a noisy verdict is
    early = profile_scored(cpu_ws, QUICK, until=lambda p: p.paired.stopped == "decided")
    full_cfg = QUICK.model_copy(update={"early_stop": False})
    full = profile_scored(cpu_ws, full_cfg)
    assert _outcome(early, QUICK) == _outcome(full, full_cfg) == "correct"
    # three rounds decide it, unless the judge's clock could not bound the candidate yet on a loaded machine (the
    # stop waits for the bound): fewer rounds than the budget either way
    assert early.paired.stopped == "decided" and 3 == early.paired.min_rounds <= len(early.paired.rounds) < 5
    assert full.paired.stopped == "max_rounds" and len(full.paired.rounds) == full.paired.max_rounds == 5
    te = 1.1 if early.launch_bound else 1.0  # the small task is launch-bound on most machines
    assert early.speedup_vs_eager_range[1] < 1.0 and early.paired.stop_thresholds[0] == (te, te)
    assert early.checks["spot_checks"] >= 1  # the floor: a timing checks at least one call
    # each profile's spot checks: under the shared lock only, the timing's hold stepped down to it
    assert len(seen) >= 2 and all(s == ["shared"] for s in seen), seen  # one a scored profile, retries included
    for p in (early, full):
        assert 0 < p.exclusive_s < p.duration_s and "spot_checks" in p.phases
    assert f"{len(early.paired.rounds)} of 5 rounds (stopped: decided)" in early.message  # 3, or 4 once the bound held


@pytest.fixture(scope="module")
def fast_ws(built_cpu_workspace, tmp_path_factory):
    """The fixture's kernel against a reference that takes the long way round (long_task.py): the same inputs
    and parameters as the small task, so the small task's build serves, and eager is several times slower."""
    root = tmp_path_factory.mktemp("fast") / "ws"
    ws, _ = init_workspace(str(FIXTURES / "cpu_multi" / "long_task.py"), root, backend="cpu", check=False)
    for d in ("kernels", "build"):
        shutil.copytree(built_cpu_workspace / d, ws.root / d, dirs_exist_ok=True)
    set_variant(ws.root, "correct")
    v = verify_workspace(ws, VerifyConfig(trials=1))  # no compile: the copied build is current for kernels/
    assert v.ok, v.message
    return ws


@pytest.mark.full  # builds a faster extension of its own; the rule: the scripted tests above; a real early stop: test_a_clearly_slower_candidate_stops_early_with_the_full_timings_milestone
def test_a_clearly_faster_candidate_runs_the_full_budget_and_keeps_its_milestone(fast_ws):
    """Every round above the threshold decides nothing before the budget ends (the rounds to come could pull the
    confidence bound below it): the faster kernel is timed over all five rounds, with or without the early stop."""
    # launch_bound_ms makes the task launch-bound for this test, so torch.compile's figure (Inductor's CPU code on a
    # shared machine moves by orders of magnitude) plays no part: one threshold, faster_than_eager's 1.1
    cfg = QUICK.model_copy(update={"launch_bound_ms": 1e9})
    early = profile_scored(fast_ws, cfg)
    full_cfg = cfg.model_copy(update={"early_stop": False})
    full = profile_scored(fast_ws, full_cfg)
    assert _outcome(early, cfg) == _outcome(full, full_cfg) == "faster_than_eager"
    assert early.paired.stop_thresholds == [(1.1, 1.1)]
    assert early.speedup_vs_eager_ci[0] == min(r.speedup for r in early.paired.rounds) > 1.1
    for p in (early, full):
        assert p.paired.stopped == "max_rounds" and len(p.paired.rounds) == 5


@pytest.mark.full  # on the build above (as above)
def test_a_candidate_inside_a_thresholds_range_runs_to_the_maximum(fast_ws):
    """torch.compile's threshold on the eager scale is a range (the baseline's ratio between its quartiles). A
    baseline whose compiled quartiles reach from 0 to twice eager puts it at 1.0 to beyond any speedup: every
    round of this candidate lies inside, the rounds cannot decide, and the timing runs its full budget."""
    cfg = QUICK.model_copy(update={"stop_tolerance": 0.0})
    assert profile_scored(fast_ws, cfg).ok  # the baseline, measured and cached
    name, version = device_identity("cpu")
    key = baseline.baseline_key(fast_ws.meta.task_sha256, name, version, "cpu", cfg)
    record = baseline.load_cached(key)
    med = record["eager"]["median_ms"]
    wide = {**record["eager"], "median_ms": med, "iqr_ms": 2 * med}
    # its checks left out: a compiled figure found noisy would be measured again (scoring.scored), replacing this one
    baseline.store(key, {**record, "compiled": wide, "compile_checks": None})
    try:
        p = profile_scored(fast_ws, cfg)
        assert p.ok, p.message
        (te, _), (lo, hi) = p.paired.stop_thresholds
        assert te == 1.0 and lo < p.speedup_vs_eager_range[0] and hi is None
        assert p.paired.stopped == "max_rounds" and len(p.paired.rounds) == 5
    finally:
        baseline.store(key, record)


def test_early_stop_settings_reach_the_rule():
    b = scripted_baseline()
    assert early_stop.stop_rule(b, QUICK.model_copy(update={"early_stop": False}), "cpu") is None
    rule = early_stop.stop_rule(b, QUICK.model_copy(update={"reward": R.model_copy(update={"eager_margin": 0.5})}),
                                "cpu")
    assert rule.bands == [(1.5, 1.5)] and rule.min_rounds == 3 and rule.tolerance == QUICK.stop_tolerance
