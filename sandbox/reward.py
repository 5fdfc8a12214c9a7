"""Milestone rewards, computed only from the judge's own results."""

from __future__ import annotations

import math
from collections.abc import Sequence

from sandbox.config import RewardConfig
from sandbox.results import (
    INTEGRITY_REASONS,
    UNJUDGED_REASONS,
    CompileResult,
    ProfileResult,
    Reason,
    RewardResult,
    VerifyResult,
)


def eager_threshold(cfg: RewardConfig, launch_bound: bool | None) -> float:
    """faster_than_eager needs speedup_vs_eager above this. The one place the milestones' thresholds are
    computed: milestone_reward decides with them, and profile's early stop (sandbox/timing/early_stop.py)
    stops only once its rounds are on one side of them."""
    return 1.0 + (max(cfg.eager_margin, cfg.launch_bound_eager_margin) if launch_bound else cfg.eager_margin)


def compile_threshold(cfg: RewardConfig, launch_bound: bool | None) -> float | None:
    """faster_than_compile needs speedup_vs_compile above this (and faster_than_eager); None where it cannot be
    earned (a launch-bound task, unless launch_bound_counts)."""
    return 1.0 + cfg.compile_margin if not launch_bound or cfg.launch_bound_counts else None


def lower_rank(n: int, confidence: float) -> int:
    """r: the r-th slowest of n rounds is a one-sided lower confidence bound on their median speedup at `confidence`,
    distribution-free (each round is above the median with probability 1/2, so the r-th slowest is above it only when
    fewer than r rounds are below: a binomial tail). The largest r that holds; 1 (the slowest round) where even that
    falls short of `confidence`, as with 4 rounds or fewer at 0.95: the bound is then the best the rounds give."""
    r = 1
    while r < n and sum(math.comb(n, i) for i in range(r + 1)) / 2**n <= 1 - confidence:
        r += 1
    return r


def speedup_bounds(speedups: Sequence[float], confidence: float) -> tuple[float, float] | None:
    """The median speedup's confidence interval from the rounds' speedups (lower_rank from either end); None for
    no rounds. A milestone rests on its lower end (docs/judge.md, "Speed milestones rest on a confidence bound")."""
    s = sorted(speedups)
    if not s:
        return None
    r = lower_rank(len(s), confidence)
    return s[r - 1], s[len(s) - r]


def caught_cheating(result: VerifyResult | ProfileResult | CompileResult | None) -> Reason | None:
    """The integrity reason a result failed with, if it did (see INTEGRITY_REASONS)."""
    if result is None or result.ok or result.reason is None:
        return None
    return result.reason if result.reason in INTEGRITY_REASONS else None


def milestone_reward(compiled: CompileResult | None, verified: VerifyResult | None,
                     profiled: ProfileResult | None, config: RewardConfig | None = None) -> RewardResult:
    """failed < correct < faster than eager < faster than torch.compile (by the configured margins).

    A speedup counts only when verify passed; a profile of an incorrect kernel earns nothing. A profile
    that caught the candidate cheating (an integrity reason) makes the whole episode failed: otherwise a
    kernel honest only while verified would earn what an honest slow kernel earns. A profile that failed
    for an innocent reason (a timeout, the baseline's OOM) leaves the `correct` milestone; when that reason
    is timing_noisy (the machine too noisy to time a speedup) the reward carries it, so that callers who cache
    verdicts know this one is about the machine, not the files.
    """
    cfg = config or RewardConfig()
    is_compiled = bool(compiled and compiled.ok)
    verified_ok = bool(is_compiled and verified and verified.ok)
    timed = profiled is not None and profiled.ok
    se = profiled.speedup_vs_eager if timed else None
    sc = profiled.speedup_vs_compile if timed else None
    launch_bound = profiled.launch_bound if timed else None
    common = dict(compiled=is_compiled, speedup_vs_eager=se, speedup_vs_compile=sc, launch_bound=launch_bound)
    if not is_compiled:
        reason = compiled.reason if compiled is not None else None
        return RewardResult(reward=cfg.failed, milestone="failed", correct=False, reason=reason, **common)
    if not verified_ok and verified is not None and verified.reason in UNJUDGED_REASONS:
        # the task could not be run on this device (sandbox/correctness/oom.py): no verdict on the kernel
        return RewardResult(reward=cfg.unjudged, milestone="failed", correct=False, reason=verified.reason, **common)
    if not verified_ok:
        return RewardResult(reward=cfg.failed, milestone="failed", correct=False,
                            reason=verified.reason if verified is not None else None, **common)
    cheat = caught_cheating(profiled)
    if cheat is not None:
        return RewardResult(reward=cfg.failed, milestone="failed", correct=False, reason=cheat,
                            compiled=is_compiled, launch_bound=None)
    if profiled is not None and not profiled.ok and profiled.reason == Reason.timing_noisy:
        # the judge could not time it, through no fault of the kernel: correct, and the reason says why no more
        return RewardResult(reward=cfg.correct, milestone="correct", correct=True, reason=Reason.timing_noisy,
                            **common)
    # the lower ends of the speedups' confidence intervals, not the medians: an honest kernel at 1.0x eager earns
    # faster_than_eager only as often as the interval misses, never half the time (issue 68, item 5)
    se_low, sc_low = _lower(profiled, "eager", cfg) if timed else None, _lower(profiled, "compile", cfg) if timed else None
    faster_than_eager = se_low is not None and se_low > eager_threshold(cfg, launch_bound)
    tc = compile_threshold(cfg, launch_bound)
    # never on a torch.compile figure the profile found noisy and did not measure again (ProfileResult.compile_noise)
    trusted = profiled is not None and profiled.compile_noise is None
    if faster_than_eager and tc is not None and sc_low is not None and sc_low > tc and trusted:
        return RewardResult(reward=cfg.faster_than_compile, milestone="faster_than_compile", correct=True, **common)
    if faster_than_eager:
        return RewardResult(reward=cfg.faster_than_eager, milestone="faster_than_eager", correct=True, **common)
    return RewardResult(reward=cfg.correct, milestone="correct", correct=True, **common)


def _lower(p: ProfileResult, vs: str, cfg: RewardConfig) -> float | None:
    """A scored profile's speedup over eager or torch.compile, at the lower end of its confidence interval: from the
    paired rounds at cfg.speedup_confidence (the compile one through the baseline ratio's lower quartile bound), else
    the interval the profile computed, else (a record without either) its slowest round, else the point estimate."""
    point = p.speedup_vs_eager if vs == "eager" else p.speedup_vs_compile
    if point is None:
        return None
    kept = [r.speedup for r in p.paired.rounds if r.counted] if p.paired is not None else []
    if kept and all(x is not None for x in kept):
        bounds = speedup_bounds(kept, cfg.speedup_confidence)
        if bounds is not None and p.speedup_vs_eager:
            low = bounds[0]
            if vs == "eager":
                return low
            # speedup_vs_compile = speedup_vs_eager x ratio, the ratio's lower end from speedup_vs_compile_range
            ratio_low = (p.speedup_vs_compile_range[0] / p.speedup_vs_eager_range[0]
                         if p.speedup_vs_compile_range and p.speedup_vs_eager_range and p.speedup_vs_eager_range[0] > 0
                         else point / p.speedup_vs_eager)
            return low * ratio_low
    ci = p.speedup_vs_eager_ci if vs == "eager" else p.speedup_vs_compile_ci
    if ci is not None:
        return ci[0]
    rng = p.speedup_vs_eager_range if vs == "eager" else p.speedup_vs_compile_range
    return rng[0] if rng is not None else point
