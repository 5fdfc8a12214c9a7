import pytest

from conftest import profile_scored, set_variant
from sandbox import present
from sandbox.api import milestone_reward, profile_workspace
from sandbox.config import COMPILE_MODES, ProfileConfig, RewardConfig
from sandbox.results import INTEGRITY_REASONS, CompileResult, ProfileResult, Reason, Timing, VerifyResult
from sandbox.timing.baseline import baseline_key, needs_retime, speedup_range, time_with_retime

QUICK = ProfileConfig(target_ms=100, max_trials=30, warmup_ms=10)


def test_profile_times_eager_compile_and_candidate_then_caches_the_baseline(cpu_ws):
    set_variant(cpu_ws.root, "correct")
    first = profile_workspace(cpu_ws, QUICK)
    assert not first.baseline_cached and first.compile_error is None, first.compile_error
    if first.reason == Reason.timing_noisy:  # the baseline stays measured; its timings need a scored profile
        first = profile_scored(cpu_ws, QUICK)
    assert first.ok, first.message
    for t in (first.eager, first.compiled, first.candidate):
        assert t is not None and t.trials >= QUICK.min_trials and 0 < t.min_ms <= t.median_ms <= t.max_ms
    # eager was timed beside the candidate: one more batch than the candidate's, each round between two
    pr = first.paired
    assert len(first.eager.batches) == len(pr.rounds) + 1 == len(first.candidate.batches) + 1
    assert pr.min_rounds <= len(pr.rounds) <= pr.max_rounds == QUICK.timing_batches  # it may stop early
    for r, c, before, after in zip(pr.rounds, first.candidate.batches, first.eager.batches, first.eager.batches[1:],
                                   strict=False):
        assert (r.candidate_ms, r.eager_before_ms, r.eager_after_ms) == (c.reported_median_ms, before.reported_median_ms,
                                                                         after.reported_median_ms)
        assert r.speedup == pytest.approx((before.reported_median_ms + after.reported_median_ms) / 2 / c.reported_median_ms)
    ratios = sorted(r.speedup for r in pr.rounds)
    assert first.speedup_vs_eager == pytest.approx(ratios[len(ratios) // 2])
    assert first.speedup_vs_eager_range == (ratios[0], ratios[-1])
    # torch.compile is not timed in the profile: the baseline's ratio to eager, applied to the paired eager
    assert (pr.baseline_age_s == 0.0) is not first.baseline_cached and pr.baseline_compiled_ms is not None
    # (over the mean of the eager timings either side of torch.compile's in the baseline: baseline.compile_timed)
    ratio = pr.compile_ratio
    assert ratio is not None and first.speedup_vs_compile == pytest.approx(first.speedup_vs_eager * ratio)
    assert first.compiled.median_ms == pytest.approx(first.eager.median_ms * ratio)
    assert first.torch_version and first.device
    # the top ops were measured under the profiler: its own cost is measured, and the rows add up to it
    assert first.top_kernels and first.profiler is not None
    cost = first.profiler
    assert cost.plain_ms_per_call > 0 and cost.profiled_ms_per_call > 0
    assert cost.overhead_factor == pytest.approx(cost.profiled_ms_per_call / cost.plain_ms_per_call)
    assert sum(k.total_ms for k in first.top_kernels) <= cost.rows_ms_per_call * 1.0001
    assert cost.rows_ms_per_call <= cost.profiled_ms_per_call * 1.05
    text = present.profile_text(first)
    assert "under the profiler" in text and all(k.name[:100] in text for k in first.top_kernels)
    second = profile_scored(cpu_ws, QUICK)
    assert second.ok and second.baseline_cached, second.message
    assert (second.paired.baseline_eager_ms, second.paired.baseline_compiled_ms) == (pr.baseline_eager_ms,
                                                                                     pr.baseline_compiled_ms)
    assert second.paired.baseline_age_s > 0 and second.eager != first.eager  # eager is timed again, every time
    # another compile mode is another baseline
    assert not profile_scored(cpu_ws, QUICK.model_copy(update={"use_cache": False})).baseline_cached


def test_profile_reports_candidate_failures(cpu_ws):
    set_variant(cpu_ws.root, "segfault")
    r = profile_scored(cpu_ws, QUICK)
    assert not r.ok and r.reason == "crash"


def _timing(ms: float) -> Timing:
    return Timing(median_ms=ms, mean_ms=ms, std_ms=0, min_ms=ms, max_ms=ms, iqr_ms=0, trials=10, input_sets=1)


def _results(ok_compile=True, ok_verify=True, eager=1.0, compiled=1.0, cand=1.0):
    c = CompileResult(ok=ok_compile, backend="cpu", duration_s=1)
    v = VerifyResult(ok=ok_verify, backend="cpu", atol=0.01, rtol=0.01, duration_s=1)
    p = ProfileResult(ok=True, backend="cpu", compile_mode="default", eager=_timing(eager),
                      compiled=_timing(compiled), candidate=_timing(cand), speedup_vs_eager=eager / cand,
                      speedup_vs_compile=compiled / cand, duration_s=1)
    return c, v, p


@pytest.mark.parametrize("kw, reward, milestone", [
    ({"ok_compile": False}, -1, "failed"),
    ({"ok_verify": False, "eager": 10.0, "compiled": 10.0}, -1, "failed"),  # fast but wrong earns nothing
    ({"eager": 1.0, "compiled": 0.5, "cand": 1.2}, 1, "correct"),
    ({"eager": 2.0, "compiled": 1.0, "cand": 1.0}, 2, "faster_than_eager"),
    ({"eager": 2.0, "compiled": 1.04, "cand": 1.0}, 2, "faster_than_eager"),  # under the 5% margin
    ({"eager": 2.0, "compiled": 1.06, "cand": 1.0}, 3, "faster_than_compile"),
])
def test_milestones(kw, reward, milestone):
    r = milestone_reward(*_results(**kw))
    assert (r.reward, r.milestone) == (reward, milestone)


def test_reward_values_are_configurable():
    cfg = RewardConfig(failed=0.0, correct=0.5, faster_than_eager=0.75, faster_than_compile=1.0, compile_margin=0.2)
    assert milestone_reward(*_results(eager=2.0, compiled=1.1, cand=1.0), cfg).reward == 0.75
    assert milestone_reward(*_results(eager=2.0, compiled=1.3, cand=1.0), cfg).reward == 1.0
    assert milestone_reward(*_results(ok_verify=False), cfg).reward == 0.0


def test_launch_bound_flag_and_speedup_ranges_on_a_tiny_task(cpu_ws):
    set_variant(cpu_ws.root, "correct")
    # no re-timing on drift (not part of the baseline's key either): on a loaded 2-core CI machine the first
    # profile's baseline can read slower than the second's eager, and a re-timed baseline is not the cached one
    steady = QUICK.model_copy(update={"baseline_max_drift": 1e6})
    floor_high = profile_scored(cpu_ws, steady.model_copy(update={"launch_bound_ms": 1e6}))
    assert floor_high.ok, floor_high.message
    assert floor_high.launch_bound is True
    lo, hi = floor_high.speedup_vs_eager_range
    assert lo <= floor_high.speedup_vs_eager <= hi
    text = present.profile_text(floor_high)
    assert "launch-bound" in text and f"[{lo:.2f}-{hi:.2f}]" in text
    # the floor is not part of the baseline's key: the same cached baseline, classified the other way
    floor_zero = profile_scored(cpu_ws, steady.model_copy(update={"launch_bound_ms": 0.0}))
    assert floor_zero.ok and floor_zero.baseline_cached and floor_zero.launch_bound is False
    assert "launch-bound" not in present.profile_text(floor_zero)


def test_launch_bound_tasks_stay_out_of_the_compile_milestone():
    c, v, p = _results(eager=2.0, compiled=1.5, cand=1.0)
    assert milestone_reward(c, v, p).milestone == "faster_than_compile"
    p = p.model_copy(update={"launch_bound": True})
    r = milestone_reward(c, v, p)
    assert (r.milestone, r.reward, r.launch_bound) == ("faster_than_eager", 2, True)
    assert milestone_reward(c, v, p, RewardConfig(launch_bound_counts=True)).milestone == "faster_than_compile"


@pytest.mark.parametrize("launch_bound, eager, milestone", [
    (False, 1.07, "faster_than_eager"),
    (True, 1.07, "correct"),  # the same kernel judged 1.07x in one run and under 1.0x in another (docs/judge.md)
    (True, 1.12, "faster_than_eager"),
])
def test_launch_bound_tasks_need_a_margin_over_eager(launch_bound, eager, milestone):
    c, v, p = _results(eager=eager, compiled=0.5, cand=1.0)
    p = p.model_copy(update={"launch_bound": launch_bound})
    assert milestone_reward(c, v, p).milestone == milestone
    lenient = RewardConfig(launch_bound_eager_margin=0.0)
    assert milestone_reward(c, v, p, lenient).milestone == "faster_than_eager"


@pytest.mark.parametrize("reason", sorted(INTEGRITY_REASONS))
def test_caught_cheating_in_profile_fails_the_episode(reason):
    c, v, _ = _results()
    p = ProfileResult(ok=False, reason=reason, backend="cpu", compile_mode="default", duration_s=1)
    r = milestone_reward(c, v, p)
    assert (r.reward, r.milestone, r.correct, r.reason) == (-1, "failed", False, reason)
    assert reason in present.reward_text(r) and "caught" in present.reward_text(r)


@pytest.mark.parametrize("reason", [Reason.timeout, Reason.oom, Reason.reference_error, Reason.crash,
                                    Reason.internal_error])
def test_innocent_profile_failures_keep_correct(reason):
    c, v, _ = _results()
    p = ProfileResult(ok=False, reason=reason, backend="cpu", compile_mode="default", duration_s=1)
    r = milestone_reward(c, v, p)
    assert (r.reward, r.milestone, r.correct, r.reason) == (1, "correct", True, None)


def test_verify_failure_reason_is_the_rewards():
    c, _, p = _results()
    v = VerifyResult(ok=False, reason=Reason.torch_op_used, backend="cpu", atol=0.01, rtol=0.01, duration_s=1)
    assert milestone_reward(c, v, p).reason == Reason.torch_op_used


def _t(median: float, iqr: float) -> dict:
    return {**_timing(median).model_dump(), "iqr_ms": iqr}


def test_noisy_baselines_are_retimed_and_the_steadiest_kept():
    cfg = ProfileConfig(retime_iqr_fraction=0.2, retime_max=2)
    runs = iter([_t(1.0, 0.5), _t(1.1, 0.1), _t(9.9, 9.9)])
    got = time_with_retime(lambda: next(runs), cfg)
    assert got["median_ms"] == 1.1 and got["retimed"] == 1  # steady after one repeat: no third run
    runs = iter([_t(1.0, 0.5), _t(1.0, 0.4), _t(1.0, 0.3), _t(0.1, 0.0)])
    got = time_with_retime(lambda: next(runs), cfg)
    assert got["iqr_ms"] == 0.3 and got["retimed"] == 2  # gives up after retime_max
    steady = iter([_t(1.0, 0.1)])
    assert time_with_retime(lambda: next(steady), cfg)["retimed"] == 0
    assert needs_retime(_t(0.0, 0.0), cfg)  # a zero median says nothing


def test_compile_mode_and_retime_settings_are_in_the_baseline_key():
    keys = {baseline_key("sha", "dev", "2.13", "cuda", ProfileConfig(compile_mode=m)) for m in COMPILE_MODES}
    assert len(keys) == len(COMPILE_MODES)
    base = baseline_key("sha", "dev", "2.13", "cuda", ProfileConfig())
    assert base != baseline_key("sha", "dev", "2.13", "cuda", ProfileConfig(retime_iqr_fraction=0.5))
    assert base == baseline_key("sha", "dev", "2.13", "cuda", ProfileConfig(launch_bound_ms=5))


def test_speedup_range_brackets_the_median_ratio():
    base = Timing(**_t(2.0, 0.4))
    cand = Timing(**_t(1.0, 0.2))
    lo, hi = speedup_range(base, cand)
    assert lo == pytest.approx(1.8 / 1.1) and hi == pytest.approx(2.2 / 0.9) and lo < 2.0 < hi
    assert speedup_range(base, Timing(**_t(1.0, 3.0))) is None


def test_a_forbidden_model_new_is_failed_through_evaluate(cpu_ws):
    """sandbox.api.evaluate (compile, verify, profile, reward): the static scan's refusal costs -1."""
    from sandbox.api import evaluate

    (cpu_ws.root / "model_new.py").write_text(
        "import torch\nimport torch.nn as nn\nimport cuda_extension\n\n\nclass ModelNew(nn.Module):\n"
        "    def __init__(self, features):\n        super().__init__()\n"
        "        self.bias = nn.Parameter(torch.empty(features))\n\n"
        "    def forward(self, x):\n        y = cuda_extension.correct(x, self.bias)\n"
        "        pd = getattr(torch.utils, '_python' + '_dispatch')\n"
        "        with pd._disable_current_modes():\n            return y + 0\n")
    c, v, p, r = evaluate(cpu_ws)
    assert c.ok and v is not None and v.reason == Reason.forbidden_construct, v
    assert p is None
    assert (r.reward, r.milestone, r.reason) == (-1.0, "failed", Reason.forbidden_construct)
    p = profile_workspace(cpu_ws, QUICK)
    assert not p.ok and p.reason == Reason.forbidden_construct and p.message == v.message
    assert p.reason in INTEGRITY_REASONS
