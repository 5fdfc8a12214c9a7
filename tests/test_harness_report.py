"""The report's metrics on a small set of judged episodes whose values are worked out by hand."""

from __future__ import annotations

import json
import math

import pytest

from harness.metrics import compute_metrics, fast_p, geomean_all, geomean_correct, result_of
from harness.report import build_report, write_report
from harness.trajectory import EpisodeRecord, Judgment, TaskRef
from sandbox.results import CompileResult, ProfileResult, Reason, Timing, VerifyResult
from sandbox.reward import milestone_reward


def timing(ms: float) -> Timing:
    return Timing(median_ms=ms, mean_ms=ms, std_ms=0.0, min_ms=ms, max_ms=ms, iqr_ms=0.0, trials=10, input_sets=1)


def record(task: str, *, compiled: bool = True, correct: bool = True, eager: float | None = None,
           compile_: float | None = None, sample: int = 0, reason: Reason | None = None) -> EpisodeRecord:
    """An episode whose ModelNew took 1 ms; eager and compile are the baselines' times (speedup = time / 1)."""
    c = CompileResult(ok=compiled, reason=None if compiled else Reason.compile_error, backend="cuda", duration_s=1)
    v = VerifyResult(ok=correct, reason=None if correct else reason or Reason.value_mismatch, backend="cuda",
                     device="H100", atol=0.01, rtol=0.01, duration_s=1) if compiled else None
    p = None
    if compiled and correct:
        p = ProfileResult(ok=True, backend="cuda", device="NVIDIA H100 80GB HBM3", torch_version="2.13.0",
                          compile_mode="default", eager=timing(eager), candidate=timing(1.0),
                          compiled=timing(compile_) if compile_ else None,
                          compile_error=None if compile_ else "inductor failed", speedup_vs_eager=eager,
                          speedup_vs_compile=compile_, duration_s=1)
    level, name = task.split("/")
    judgment = Judgment(compile=c, verify=v, profile=p, reward=milestone_reward(c, v, p),
                        settings={"verify_trials": 5, "compile_mode": "default", "atol": 0.01, "rtol": 0.01})
    return EpisodeRecord(episode_id=f"{task}-{sample}", key=f"kernelbench/{task}#{sample}",
                         task=TaskRef(id=f"kernelbench/{task}", sha256="0" * 64, level=level), sample=sample,
                         policy={"provider": "openai", "model": "m"}, ended="model_stopped", judgment=judgment,
                         backend="cuda", started_at=0.0)


# level1: A correct 2x eager / 1.5x compile, B correct 0.5x / 0.25x, C does not compile
# level2: D correct 4x eager (torch.compile failed for the reference), E compiles but is wrong
HAND = [record("level1/1_A", eager=2.0, compile_=1.5), record("level1/2_B", eager=0.5, compile_=0.25),
        record("level1/3_C", compiled=False), record("level2/1_D", eager=4.0, compile_=None),
        record("level2/2_E", correct=False)]


def test_fast_p_and_geomeans_match_the_definitions():
    rows = [result_of(r) for r in HAND]
    assert [r.correct for r in rows] == [True, True, False, True, False]
    assert fast_p(rows, 0, "eager") == pytest.approx(3 / 5)  # fast_0 = pass rate
    assert fast_p(rows, 0.5, "eager") == pytest.approx(2 / 5)  # B's 0.5 is not > 0.5
    assert fast_p(rows, 1, "eager") == pytest.approx(2 / 5)
    assert fast_p(rows, 2, "eager") == pytest.approx(1 / 5)
    assert fast_p(rows, 1, "compile") == pytest.approx(1 / 5)  # D has no torch.compile speedup
    assert fast_p(rows, 0, "compile") == pytest.approx(3 / 5)
    assert geomean_correct(rows, "eager") == pytest.approx((2 * 0.5 * 4) ** (1 / 3))
    assert geomean_all(rows, "eager") == pytest.approx((2 * 0.5 * 4) ** (1 / 5))  # failures count as 1x
    assert geomean_correct(rows, "compile") == pytest.approx(math.sqrt(1.5 * 0.25))
    assert geomean_all(rows, "compile") == pytest.approx((1.5 * 0.25) ** (1 / 5))


def test_report_per_level_and_overall(tmp_path):
    report = build_report(HAND, thresholds=[0, 1, 2])
    o = report.overall
    assert (o.problems, o.compiled, o.correct, o.timed) == (5, 4, 3, 3)
    assert o.pass_rate == pytest.approx(0.6) and o.compile_rate == pytest.approx(0.8)
    assert o.fast_p_eager == pytest.approx({"0": 0.6, "1": 0.4, "2": 0.2})
    assert o.fast_p_compile == pytest.approx({"0": 0.6, "1": 0.2, "2": 0.0})
    # rewards: A 3 (beats compile by > 5%), B 1, C -1, D 2 (no compile baseline), E -1
    assert o.mean_reward == pytest.approx((3 + 1 - 1 + 2 - 1) / 5)
    assert o.milestones == {"faster_than_compile": 1, "correct": 1, "failed": 2, "faster_than_eager": 1}
    assert o.failure_reasons == {"compile_error": 1, "value_mismatch": 1}
    l1, l2 = report.levels["level1"], report.levels["level2"]
    assert l1.pass_rate == pytest.approx(2 / 3) and l2.pass_rate == pytest.approx(1 / 2)
    assert l1.fast_p_eager["1"] == pytest.approx(1 / 3) and l2.fast_p_eager["1"] == pytest.approx(1 / 2)
    assert l1.geomean_speedup_eager_correct == pytest.approx(1.0)  # sqrt(2 * 0.5)
    assert l2.geomean_speedup_eager_all == pytest.approx(2.0)  # sqrt(4 * 1)
    assert report.judge["device"] == "NVIDIA H100 80GB HBM3" and report.judge["torch_version"] == "2.13.0"
    assert report.judge["verify_trials"] == 5 and report.samples == 1 and report.best_of_k is None

    pytest.importorskip("matplotlib", reason="the harness extra is not installed")
    written = write_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["overall"]["fast_p_eager"]["1"] == pytest.approx(0.4)
    assert len(data["problems"]) == 5
    md = (tmp_path / "report.md").read_text()
    assert "| overall | 5 | 80.0% | 60.0% |" in md and "kernelbench/level2/2_E" in md
    for png in ("fast_p.png", "speedups.png"):
        path = tmp_path / "plots" / png
        assert path in written and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_best_of_k_takes_each_problems_best_sample():
    recs = [record("level1/1_A", correct=False, sample=0), record("level1/1_A", eager=3.0, compile_=0.9, sample=1),
            record("level1/2_B", eager=1.5, compile_=1.2, sample=0), record("level1/2_B", eager=2.5, compile_=2.0,
                                                                           sample=1)]
    report = build_report(recs, thresholds=[0, 1])
    assert report.samples == 2
    assert report.overall.pass_rate == pytest.approx(3 / 4)  # over all episodes: the single-sample estimate
    best = report.best_of_k["overall"]
    assert best.problems == 2 and best.pass_rate == 1.0
    assert best.geomean_speedup_eager_correct == pytest.approx(math.sqrt(3.0 * 2.5))


def test_empty_groups_do_not_divide_by_zero():
    m = compute_metrics([], [0, 1])
    assert m.problems == 0 and m.pass_rate == 0.0 and m.geomean_speedup_eager_all is None


def test_a_correct_solution_the_profile_could_not_time_says_why():
    """A correct row whose profile came back timing_noisy: no speedup, no failure reason, and the profile's
    reason in its own column (the report and the eval test tell an untimed row from a timed one by it)."""
    rec = record("level1/1_A", eager=2.0, compile_=1.5)
    noisy = ProfileResult(ok=False, reason=Reason.timing_noisy, message="too noisy", backend="cuda",
                          compile_mode="default", duration_s=1)
    j = rec.judgment.model_copy(update={"profile": noisy,
                                        "reward": milestone_reward(rec.judgment.compile, rec.judgment.verify, noisy)})
    row = result_of(rec.model_copy(update={"judgment": j}))
    assert row.correct and row.reason is None and row.profile_reason == "timing_noisy"
    assert row.speedup_vs_eager is None and row.candidate_ms is None
    assert result_of(rec).profile_reason is None  # timed
    report = build_report([rec.model_copy(update={"judgment": j})], thresholds=[0])
    assert report.overall.timed == 0 and report.overall.correct == 1
