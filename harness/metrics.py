"""KernelBench-style metrics over judged episodes.

Definitions (n = problems in the group, each a judged episode):
  pass rate       correct / n (compiled and verified by the judge)
  fast_p          (1/n) * #{correct and speedup > p}; speedup against eager or torch.compile.
                  fast_0 is the pass rate (a correct result that could not be timed still counts),
                  for p > 0 a result needs a measured speedup above p.
  geomean, correct  exp(mean(log speedup)) over correct problems with a measured speedup
  geomean, all      the same over all n problems, a failed (or untimed) problem counting as 1x
With several samples per problem the metrics are taken over all episodes (an estimate of the
single-sample value) and, separately, over the best sample of each problem ("best of k").
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, Field

from harness.trajectory import EpisodeRecord

Baseline = Literal["eager", "compile"]
DEFAULT_THRESHOLDS = [0.0, 0.5, 0.8, 1.0, 1.2, 1.5, 2.0, 3.0]


class ProblemResult(BaseModel):
    task_id: str
    level: str
    sample: int = 0
    compiled: bool
    correct: bool
    milestone: str
    reward: float
    reason: str | None = Field(None, description="why it failed: the compile or verify reason, or how it ended")
    profile_reason: str | None = Field(None, description="why a correct solution has no speedup: the profile's "
                                       "reason (timing_noisy on a loaded machine, a profile error); None when timed")
    speedup_vs_eager: float | None = None
    speedup_vs_compile: float | None = None
    eager_ms: float | None = None
    compiled_ms: float | None = None
    candidate_ms: float | None = None
    turns: int = 0
    ended: str = ""
    device: str | None = None
    launch_bound: bool | None = Field(None, description="eager below the floor: the compile milestone did not count")

    def speedup(self, baseline: Baseline) -> float | None:
        return self.speedup_vs_eager if baseline == "eager" else self.speedup_vs_compile


def result_of(rec: EpisodeRecord) -> ProblemResult:
    j = rec.judgment
    c = j.compile if j else None
    v = j.verify if j else None
    p = j.profile if j else None
    reward = j.reward if j else None
    correct = bool(reward and reward.correct)
    reason = None
    if not correct:
        if reward is not None and reward.reason is not None:
            reason = str(reward.reason)
        elif c is not None and not c.ok:
            reason = str(c.reason or "compile_error")
        elif v is not None and not v.ok:
            reason = str(v.reason or "verify_failed")
        else:
            reason = rec.ended
    timed = p is not None and p.ok
    profile_reason = str(p.reason or "profile_failed") if correct and p is not None and not p.ok else None
    return ProblemResult(
        task_id=rec.task.id, level=rec.task.level, sample=rec.sample, compiled=bool(reward and reward.compiled),
        correct=correct, milestone=reward.milestone if reward else "failed", reward=reward.reward if reward else -1.0,
        reason=reason, profile_reason=profile_reason, speedup_vs_eager=reward.speedup_vs_eager if reward else None,
        speedup_vs_compile=reward.speedup_vs_compile if reward else None,
        eager_ms=p.eager.median_ms if timed and p.eager else None,
        compiled_ms=p.compiled.median_ms if timed and p.compiled else None,
        candidate_ms=p.candidate.median_ms if timed and p.candidate else None,
        launch_bound=reward.launch_bound if reward else None, turns=len(rec.turns), ended=rec.ended,
        device=(p.device if p else None) or (v.device if v else None))


def fast_p(rows: list[ProblemResult], p: float, baseline: Baseline) -> float:
    if not rows:
        return 0.0
    if p <= 0:
        return sum(r.correct for r in rows) / len(rows)
    hits = 0
    for r in rows:
        s = r.speedup(baseline)
        if r.correct and s is not None and s > p:
            hits += 1
    return hits / len(rows)


def geomean(values: Iterable[float]) -> float | None:
    logs = [math.log(v) for v in values if v is not None and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def geomean_correct(rows: list[ProblemResult], baseline: Baseline) -> float | None:
    return geomean(s for r in rows if r.correct and (s := r.speedup(baseline)) is not None)


def geomean_all(rows: list[ProblemResult], baseline: Baseline) -> float | None:
    if not rows:
        return None
    return geomean((s if r.correct and (s := r.speedup(baseline)) is not None else 1.0) for r in rows)


def curve(rows: list[ProblemResult], baseline: Baseline, ps: list[float]) -> list[float]:
    return [fast_p(rows, p, baseline) for p in ps]


def p_grid(rows: list[ProblemResult], step: float = 0.01) -> list[float]:
    top = max([3.0] + [min(s, 20.0) for r in rows for s in (r.speedup_vs_eager, r.speedup_vs_compile) if s])
    n = int(math.ceil(top / step)) + 1
    return [round(i * step, 6) for i in range(n + 1)]


class Metrics(BaseModel):
    problems: int
    compiled: int
    correct: int
    timed: int = Field(description="correct and with a measured speedup against eager")
    compile_rate: float
    pass_rate: float
    fast_p_eager: dict[str, float]
    fast_p_compile: dict[str, float]
    geomean_speedup_eager_correct: float | None
    geomean_speedup_eager_all: float | None
    geomean_speedup_compile_correct: float | None
    geomean_speedup_compile_all: float | None
    mean_reward: float | None
    milestones: dict[str, int]
    failure_reasons: dict[str, int]


def _key(p: float) -> str:
    return f"{p:g}"


def compute_metrics(rows: list[ProblemResult], thresholds: list[float] | None = None) -> Metrics:
    ps = thresholds if thresholds is not None else DEFAULT_THRESHOLDS
    n = len(rows)
    return Metrics(
        problems=n, compiled=sum(r.compiled for r in rows), correct=sum(r.correct for r in rows),
        timed=sum(r.correct and r.speedup_vs_eager is not None for r in rows),
        compile_rate=sum(r.compiled for r in rows) / n if n else 0.0,
        pass_rate=sum(r.correct for r in rows) / n if n else 0.0,
        fast_p_eager={_key(p): fast_p(rows, p, "eager") for p in ps},
        fast_p_compile={_key(p): fast_p(rows, p, "compile") for p in ps},
        geomean_speedup_eager_correct=geomean_correct(rows, "eager"),
        geomean_speedup_eager_all=geomean_all(rows, "eager"),
        geomean_speedup_compile_correct=geomean_correct(rows, "compile"),
        geomean_speedup_compile_all=geomean_all(rows, "compile"),
        mean_reward=sum(r.reward for r in rows) / n if n else None,
        milestones=dict(Counter(r.milestone for r in rows)),
        failure_reasons=dict(Counter(r.reason for r in rows if not r.correct and r.reason)))


def best_of_samples(rows: list[ProblemResult]) -> list[ProblemResult]:
    """Per problem, the best sample: correct before failed, then the larger speedup over eager."""
    groups: dict[str, list[ProblemResult]] = defaultdict(list)
    for r in rows:
        groups[r.task_id].append(r)

    def rank(r: ProblemResult) -> tuple:
        return (r.correct, r.reward, r.speedup_vs_eager or 0.0, -r.sample)

    return [max(g, key=rank) for g in groups.values()]


def by_level(rows: list[ProblemResult]) -> dict[str, list[ProblemResult]]:
    out: dict[str, list[ProblemResult]] = defaultdict(list)
    for r in rows:
        out[r.level].append(r)
    return dict(sorted(out.items()))
