import pytest

from conftest import set_variant
from sandbox.api import milestone_reward, profile_workspace
from sandbox.config import ProfileConfig, RewardConfig
from sandbox.present import profile_text
from sandbox.results import CompileResult, ProfileResult, Timing, VerifyResult

QUICK = ProfileConfig(target_ms=100, max_trials=30, warmup_ms=10)


def test_profile_times_eager_compile_and_candidate_then_caches_the_baseline(cpu_ws):
    set_variant(cpu_ws.root, "correct")
    first = profile_workspace(cpu_ws, QUICK)
    assert first.ok, first.message
    assert not first.baseline_cached
    assert first.compile_error is None, first.compile_error
    for t in (first.eager, first.compiled, first.candidate):
        assert t is not None and t.trials >= QUICK.min_trials and 0 < t.min_ms <= t.median_ms <= t.max_ms
    assert first.speedup_vs_eager == pytest.approx(first.eager.median_ms / first.candidate.median_ms)
    assert first.speedup_vs_compile == pytest.approx(first.compiled.median_ms / first.candidate.median_ms)
    assert first.torch_version and first.device
    # the top ops were measured under the profiler: its own cost is measured, and the rows add up to it
    assert first.top_kernels and first.profiler is not None
    cost = first.profiler
    assert cost.plain_ms_per_call > 0 and cost.profiled_ms_per_call > 0
    assert cost.overhead_factor == pytest.approx(cost.profiled_ms_per_call / cost.plain_ms_per_call)
    assert sum(k.total_ms for k in first.top_kernels) <= cost.rows_ms_per_call * 1.0001
    assert cost.rows_ms_per_call <= cost.profiled_ms_per_call * 1.05
    assert "under the profiler" in profile_text(first)
    second = profile_workspace(cpu_ws, QUICK)
    assert second.ok and second.baseline_cached
    assert second.eager == first.eager and second.compiled == first.compiled
    assert second.duration_s < first.duration_s
    # another compile mode is another baseline
    assert not profile_workspace(cpu_ws, QUICK.model_copy(update={"use_cache": False})).baseline_cached


def test_profile_reports_candidate_failures(cpu_ws):
    set_variant(cpu_ws.root, "segfault")
    r = profile_workspace(cpu_ws, QUICK)
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
